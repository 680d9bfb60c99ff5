"""Hugging Face safetensors <-> our parameters, through a family's key table.

A family (:mod:`focus_jax.models`) describes its checkpoints with a :class:`KeyTable`: each
Hugging Face tensor, the parameter it fills and the transform between the two layouts (a torch
``Linear`` weight is ``[out, in]``; ours are ``[in, ...out]`` for einsums). Per-layer tensors
(``model.layers.N.<name>``) are stacked on the leading axis of their stack: ``layers`` (every
layer), ``mlp`` (the dense layers of a sparse model) or ``moe`` (its sparse layers); expert
tensors (``mlp.experts.X.<name>``) also on an expert axis after it. Some of our weights are
several Hugging Face tensors side by side (:class:`Fused`): Q, K and V; an MLP's gate and up.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from focus_jax import sharding
from focus_jax.config import ConfigError, ModelConfig
from focus_jax.models.decoder import Decoder

Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


def concatenate(arrays: list[Any], axis: int) -> Any:
    """``np.concatenate``, or JAX's where an array is a JAX array: transforms run on the host
    (NumPy) or on a device (traced), :func:`load_safetensors` decides."""
    xp = jnp if any(isinstance(a, jax.Array) for a in arrays) else np
    return xp.concatenate(arrays, axis=axis)


def same(w: Any, cfg: ModelConfig) -> Any:
    """The identity transform (norm scales, biases)."""
    return w


def transposed(w: Any, cfg: ModelConfig) -> Any:
    """A torch Linear weight ``[out, in]`` as ``[in, out]`` (and back)."""
    return w.T


def linear(shape: Callable[[ModelConfig], tuple[int, ...]]) -> tuple[Transform, Transform]:
    """A torch Linear weight ``[out, in]`` transposed to ``[in, ...out]`` of ``shape(cfg)``,
    and back."""
    return (lambda w, cfg: w.T.reshape(shape(cfg)),
            lambda w, cfg: w.reshape(w.shape[0], -1).T)


def linear_out(shape: Callable[[ModelConfig], tuple[int, ...]]) -> tuple[Transform, Transform]:
    """A torch Linear weight ``[out, in]`` whose input axis we split: ``[...in, out]`` of
    ``shape(cfg)`` (an output projection from heads), and back."""
    return (lambda w, cfg: w.T.reshape(shape(cfg)),
            lambda w, cfg: w.reshape(-1, w.shape[-1]).T)


@dataclasses.dataclass(frozen=True)
class Weight:
    """One Hugging Face tensor that fills the parameter ``path`` (per layer: its path in the
    stack, the stack's name first), with the transforms between the layouts (of one layer's,
    or one expert's, slice)."""

    path: tuple[str, ...]
    to_ours: Transform = same
    to_hf: Transform = same


@dataclasses.dataclass(frozen=True)
class Fused:
    """One of our per-layer weights made of several Hugging Face tensors side by side on
    ``axis`` of one layer's (or expert's) slice, in the order of ``parts``. ``sizes(cfg)``:
    each part's slices on that axis; ``shape(cfg, n)``: the slice with ``n`` there."""

    axis: int
    parts: tuple[str, ...]
    sizes: Callable[[ModelConfig], tuple[int, ...]]
    shape: Callable[[ModelConfig, int], tuple[int, ...]]
    per_expert: bool = False
    """The parts are ``expert`` names (one slice per expert)."""

    def to_ours(self, part: str) -> Transform:
        """A part's torch Linear weight ``[out, in]`` in our layout, ``[in, ...]``."""
        size = self.sizes_of(part)

        def transform(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
            shape = self.shape(cfg, size(cfg))
            if w.size != math.prod(shape):
                raise ConfigError(f"{part} has shape {tuple(w.shape)}, config.json implies "
                                  f"{math.prod(shape[1:])} x {shape[0]}")
            return w.T.reshape(shape)

        return transform

    def sizes_of(self, part: str) -> Callable[[ModelConfig], int]:
        index = self.parts.index(part)
        return lambda cfg: self.sizes(cfg)[index]

    def join(self, parts: list[np.ndarray], cfg: ModelConfig, lead: int) -> np.ndarray:
        """The stacked fused weight from its stacked parts (``lead`` leading stack axes), in
        the order of ``parts``."""
        return concatenate(
            [part.reshape(*part.shape[:lead], *self.shape(cfg, size))
             for part, size in zip(parts, self.sizes(cfg), strict=True)], axis=self.axis + lead)

    def part(self, value: Any, name: str, cfg: ModelConfig) -> Any:
        """Part ``name`` of one slice ``value`` of the fused weight, in torch layout."""
        sizes = self.sizes(cfg)
        where = self.parts.index(name)
        start = sum(sizes[:where])
        piece = jax.lax.slice_in_dim(value, start, start + sizes[where], axis=self.axis)
        return piece.reshape(piece.shape[0], -1).T


@dataclasses.dataclass(frozen=True)
class KeyTable:
    """A family's checkpoint layout: ``globals`` (full Hugging Face keys), ``layer`` (names
    after ``model.layers.N.``), ``expert`` (names after ``model.layers.N.<experts>.X.``, ``X``
    the expert) and ``fused`` (our weight's path -> its parts, each part a ``layer`` or
    ``expert`` name mapped to that path)."""

    globals: dict[str, Weight]
    layer: dict[str, Weight]
    expert: dict[str, Weight] = dataclasses.field(default_factory=dict)
    fused: dict[tuple[str, ...], Fused] = dataclasses.field(default_factory=dict)
    experts_prefix: str = "mlp.experts"

    def weight(self, name: str, expert: bool) -> Weight:
        """The entry of a per-layer (or per-expert) name, fused parts included."""
        table = self.expert if expert else self.layer
        if name in table:
            return table[name]
        for path, fused in self.fused.items():
            if name in fused.parts and fused.per_expert == expert:
                return Weight(path, fused.to_ours(name))
        raise KeyError(name)

    def names(self, expert: bool) -> list[str]:
        """Every per-layer (or per-expert) name, fused parts included."""
        table = self.expert if expert else self.layer
        parts = [name for fused in self.fused.values() if fused.per_expert == expert
                 for name in fused.parts]
        return [*table, *parts]


def stack_of(path: tuple[str, ...], cfg: ModelConfig) -> list[int]:
    """The layers a per-layer weight's stack holds, in stack order."""
    kinds = cfg.layer_kinds
    if path[0] == "layers":
        return list(range(cfg.num_layers))
    kind = "sparse" if path[0] == "moe" else "dense"
    return [i for i, k in enumerate(kinds) if k == kind]


def not_utf8(path: Path, err: UnicodeDecodeError) -> ConfigError:
    """The error for a checkpoint's text file that does not decode."""
    return ConfigError(f"{path} is not UTF-8 text (byte {err.start}); re-download or re-convert "
                       f"the checkpoint")


def read_json(path: Path) -> Any:
    """The JSON value in ``path``; a file that is not UTF-8 JSON is a ``ConfigError`` naming it."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise not_utf8(path, err) from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err.msg} at line {err.lineno} column "
                          f"{err.colno}); re-download or re-convert the checkpoint") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the index when sharded, else the single file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(name, str) for name in weight_map.values()):
            raise ConfigError(f"{index} is not a safetensors index (it needs a 'weight_map' "
                              f"object of tensor name -> file name)")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ConfigError(f"{folder} lacks shard(s) named in its index: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} holds no *.safetensors weights (and no converted params/)")
    return files


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def checkpoint_tensors(folder: Path, dtype: Any) -> Iterator[tuple[Path, str, np.ndarray]]:
    """``(file, key, tensor)`` for every tensor of the folder's safetensors files, FP8 weights
    dequantized to ``dtype`` (:func:`dequantize_fp8`) and their scales consumed. A folder whose
    ``config.json`` names FP8 weights (:data:`focus_jax.config.FP8_CHECKPOINT_METHODS`) holds
    ``X.weight`` in float8 e4m3 with ``X.weight_scale_inv`` (a scale per block of
    ``weight_block_size``, as Qwen's and DeepSeek's FP8 releases) or ``X.weight_scale`` (one per
    output channel, or one for the tensor, as compressed-tensors' and FBGEMM's); static
    activation scales (``X.input_scale``) are not needed once the weights are dequantized."""
    files = {file: read_safetensors(file) for file in safetensors_files(folder)}
    scales = {key: tensor for tensors in files.values() for key, tensor in tensors.items()
              if key.endswith((".weight_scale_inv", ".weight_scale"))}
    block = None
    if scales:
        quantization = (read_json(folder / "config.json").get("quantization_config") or {})
        block = quantization.get("weight_block_size")
    for file, tensors in files.items():
        for key, tensor in tensors.items():
            if key in scales or key.endswith(".input_scale"):
                continue
            if tensor.dtype == ml_dtypes.float8_e4m3fn:
                scale = scales.get(key + "_scale_inv", scales.get(key + "_scale"))
                if scale is None:
                    raise ConfigError(f"tensor {key!r} in {file.name} is FP8 without a "
                                      f"{key}_scale_inv or {key}_scale to dequantize it")
                tensor = dequantize_fp8(tensor, scale, block, dtype, key)
            yield file, key, tensor


def dequantize_fp8(weight: np.ndarray, scale: np.ndarray, block: Any, dtype: Any,
                   key: str = "weight") -> np.ndarray:
    """An FP8 ``[out, in]`` weight times its scale, in ``dtype``: ``scale`` is one number, one
    per output channel (``[out, 1]``), or one per ``block = [rows, columns]`` tile
    (``[ceil(out / rows), ceil(in / columns)]``, the last tiles cut at the edges)."""
    out, inputs = weight.shape
    scale = np.asarray(scale, np.float32)
    tiles = None
    if scale.size == 1 or scale.shape == (out, 1):
        scale = scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(())
    else:
        if not (isinstance(block, list | tuple) and len(block) == 2):
            raise ConfigError(f"{key}'s scale has shape {scale.shape}, a scale per block, but "
                              f"config.json's quantization_config names no weight_block_size")
        tiles = (int(block[0]), int(block[1]))
        needed = (-(-out // tiles[0]), -(-inputs // tiles[1]))
        if scale.shape != needed:
            raise ConfigError(f"{key}'s scale has shape {scale.shape}; {tiles[0]} x {tiles[1]} "
                              f"blocks of a {out} x {inputs} weight need {needed}")
    # Compiled, on the default device: 0.8 G values/s on the 2-core CPU against 0.03 with NumPy's
    # element-wise FP8 casts (a 4096 x 12288 weight in 0.06 s against 1.6 s).
    return np.asarray(_dequantize(weight, scale, tiles, np.dtype(dtype)))


@functools.partial(jax.jit, static_argnames=("tiles", "dtype"))
def _dequantize(weight: jax.Array, scale: jax.Array, tiles: tuple[int, int] | None,
                dtype: np.dtype) -> jax.Array:
    if tiles is not None:
        out, inputs = weight.shape
        scale = jnp.repeat(jnp.repeat(scale, tiles[0], axis=0), tiles[1], axis=1)[:out, :inputs]
    return (weight.astype(jnp.float32) * scale).astype(dtype)


def read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, as read-only views of its memory map.

    Read on the host, so that loading compiles nothing and sends each parameter to the device
    once, already in its final layout (a reader returning jax arrays made every transpose and
    the per-layer stacking an XLA computation: 7 of the bundled model's 8 s of loading on CPU).
    The format: an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
    shape and byte range, then the data.
    """
    if file.stat().st_size < 8:
        raise ConfigError(f"{file} is not a safetensors file ({file.stat().st_size} bytes); "
                          f"is the download incomplete?")
    data = np.memmap(file, dtype=np.uint8, mode="r")
    try:
        size = int(data[:8].view("<u8")[0])
        header = json.loads(bytes(data[8:8 + size]))
    except (ValueError, IndexError) as err:
        raise ConfigError(f"{file} is not a safetensors file ({err})") from None
    header.pop("__metadata__", None)
    tensors = {}
    for key, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ConfigError(f"tensor {key!r} in {file.name} has dtype {info['dtype']}, "
                              f"which focus_jax does not read")
        begin, end = (8 + size + offset for offset in info["data_offsets"])
        try:
            tensors[key] = data[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        except ValueError as err:
            raise ConfigError(f"tensor {key!r} in {file.name} does not match its header "
                              f"({err}); is the file truncated?") from None
    return tensors



def _place(value: np.ndarray | jax.Array, var: nnx.Variable, mesh: Mesh | None) -> jax.Array:
    """A tensor on the default device, or on ``mesh`` with its parameter's sharding, each
    device given only its own slice of it (this process's devices: the others load theirs)."""
    if mesh is None:
        return jnp.asarray(value)
    where = sharding.param_sharding(var, mesh)
    return jax.make_array_from_callback(value.shape, where, lambda index: value[index])


LOAD_WORKERS = 8
"""Weights converted on the device side by side while loading (:func:`load_safetensors`)."""

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def abstract_decoder(cfg: ModelConfig) -> Decoder:
    """The decoder's structure with shapes only, nothing allocated."""
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))


def _table(cfg: ModelConfig) -> KeyTable:
    from focus_jax.models import family  # the registry imports the families, which import this

    return family(cfg.model_type).key_table


class _Collected:
    """One per-layer (or per-expert) name's tensors as they are read: views of the files' memory
    maps by position, nothing copied yet. Indexed like their stack (``[layer]`` or ``[layer,
    expert]``, torch layout, the file's dtype); a layer of an expert name is its experts stacked
    (one copy, of that layer)."""

    def __init__(self, count: int, experts: int | None):
        self.lead = (count,) if experts is None else (count, experts)
        self.views: dict[tuple[int, ...], np.ndarray] = {}
        self.filled = np.zeros(self.lead, bool)

    def put(self, at: tuple[int, ...], value: np.ndarray) -> None:
        if self.views:
            first = next(iter(self.views.values()))
            if value.shape != first.shape:
                raise ConfigError(f"tensors of one name differ in shape between layers or "
                                  f"experts: {tuple(value.shape)} and {tuple(first.shape)}")
        self.views[at] = value
        self.filled[at] = True

    @property
    def _first(self) -> np.ndarray:
        return next(iter(self.views.values()))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lead, *self._first.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._first.dtype

    def __getitem__(self, at: int | tuple[int, ...]) -> np.ndarray:
        at = (at,) if isinstance(at, int | np.integer) else tuple(at)
        if len(at) == len(self.lead):
            return self.views[at]
        # One layer's experts: copied as unsigned integers of the same width, which NumPy copies
        # without holding the interpreter lock (bfloat16 is not one of its own types).
        raw = np.dtype(f"u{self.dtype.itemsize}")
        return np.stack([self.views[(*at, e)].view(raw) for e in range(self.lead[1])]
                        ).view(self.dtype)


@dataclasses.dataclass(frozen=True)
class _Pending:
    """One of our parameters still in the file's layout: its Hugging Face tensors (stacked on
    ``lead`` leading axes: none for a global, layers, or layers and experts), the function
    from one slice of them to one slice of ours, and our dtype."""

    path: tuple[str, ...]
    raw: tuple[np.ndarray | _Collected, ...]
    convert: Callable[..., Any]
    lead: int
    dtype: Any

    def slice_shape(self) -> tuple[int, ...]:
        """Our slice's shape, from the transforms alone (nothing computed)."""
        inputs = [jax.ShapeDtypeStruct(r.shape[self.lead:], r.dtype) for r in self.raw]
        try:
            return tuple(jax.eval_shape(self.convert, *inputs).shape)
        except (TypeError, ValueError) as err:
            shapes = ", ".join(str(tuple(r.shape[self.lead:])) for r in self.raw)
            raise ConfigError(f"{'.'.join(self.path)}: tensors of shape {shapes} do not fit "
                              f"config.json's sizes ({err})") from None

    def on_host(self, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, self.dtype)
        for at in np.ndindex(*shape[:self.lead]):
            out[at] = self.convert(*(r[at] for r in self.raw))
        return out

    def on_device(self, shape: tuple[int, ...]) -> jax.Array:
        """Converted on the default device, one layer at a time (each layer's tensors sent as
        they are in the file; transposing them there is far faster than on the host)."""
        per_slice = self.convert
        for _ in range(max(self.lead - 1, 0)):  # the expert axis
            per_slice = jax.vmap(per_slice)
        if self.lead == 0:
            return jax.jit(lambda *raw: per_slice(*raw).astype(self.dtype))(*self.raw)

        @functools.partial(jax.jit, donate_argnums=0)
        def write(out: jax.Array, i: jax.Array, *raw: jax.Array) -> jax.Array:
            return out.at[i].set(per_slice(*raw).astype(out.dtype))

        out = jnp.zeros(shape, self.dtype)
        for i in range(shape[0]):
            out = write(out, np.int32(i), *(r[i] for r in self.raw))
        return out


def load_safetensors(folder: Path, cfg: ModelConfig, mesh: Mesh | None = None,
                     on_device: bool | None = None) -> Decoder:
    """Build the decoder from a Hugging Face folder's safetensors weights, through its family's
    key table, cast to the parameters' dtypes (``cfg.dtype``; routers float32): on the default
    device, or each tensor straight into its shards of ``mesh`` (from host memory: no device
    holds more of a tensor than its own shard).

    ``on_device``: convert the layouts (transposes, fused weights, casts) on the default
    device rather than on the host; by default where that device is an accelerator and there is
    no mesh. On a CPU the host's NumPy is quicker (the device path compiles a program per
    weight); on an H200 host NumPy's strided transposes of SDAR-8B took most of a 75-80 s load
    (docs/startup.md)."""
    table = _table(cfg)
    abstract = abstract_decoder(cfg)
    expected = {path: var for path, var in nnx.to_flat_state(nnx.state(abstract))}
    experts_key = re.compile(re.escape(table.experts_prefix) + r"\.(\d+)\.(.+)")
    num_experts = None if cfg.moe is None else cfg.moe.num_experts
    pending: list[_Pending] = []
    collected: dict[tuple[str, bool], _Collected] = {}

    def dtype_of(path: tuple[str, ...], raw: np.ndarray) -> Any:
        return expected[path].dtype if path in expected else raw.dtype

    for file, key, tensor in checkpoint_tensors(folder, jnp.dtype(cfg.dtype)):
        if key in table.globals:
            weight = table.globals[key]
            pending.append(_Pending(weight.path, (tensor,),
                                    functools.partial(weight.to_ours, cfg=cfg), 0,
                                    dtype_of(weight.path, tensor)))
            continue
        match = _LAYER_KEY.fullmatch(key)
        if not match:
            raise ConfigError(f"unexpected tensor {key!r} in {file.name}")
        index, name = int(match.group(1)), match.group(2)
        expert_match = experts_key.fullmatch(name) if num_experts else None
        expert = None
        if expert_match:
            expert, name = int(expert_match.group(1)), expert_match.group(2)
        try:
            weight = table.weight(name, expert is not None)
        except KeyError:
            raise ConfigError(f"unexpected tensor {key!r} in {file.name}") from None
        layers = stack_of(weight.path, cfg)
        if index not in layers or (expert is not None and expert >= num_experts):
            where = (f"layer {index} of {cfg.num_layers}" if index >= cfg.num_layers else
                     f"expert {expert} of {num_experts}" if expert is not None
                     and expert >= num_experts else
                     f"layer {index} is {cfg.layer_kinds[index]} by config.json")
            raise ConfigError(f"unexpected tensor {key!r} in {file.name} ({where})")
        slot = collected.setdefault((name, expert is not None),
                                    _Collected(len(layers), num_experts if expert is not None
                                               else None))
        at = (layers.index(index),) if expert is None else (layers.index(index), expert)
        slot.put(at, tensor)
    pending += _stacked(collected, table, cfg, folder, dtype_of)
    if cfg.tie_word_embeddings:
        pending = [p for p in pending if p.path != ("lm_head",)]
    if on_device is None:
        on_device = mesh is None and jax.default_backend() != "cpu"
    return _fill(abstract, pending, folder, mesh, on_device)


def _stacked(collected: dict[tuple[str, bool], _Collected], table: KeyTable, cfg: ModelConfig,
             folder: Path, dtype_of: Callable[[tuple[str, ...], np.ndarray], Any]
             ) -> list[_Pending]:
    """The per-layer (and per-expert) parameters from the stacks read: each name's stack, or a
    fused weight's parts together; a one-line error for a layer or a part that is missing."""
    pending: list[_Pending] = []
    for (name, expert), slot in collected.items():
        if not slot.filled.all():
            missing = sorted({int(i) for i in np.argwhere(~slot.filled)[:, 0]})
            layers = stack_of(table.weight(name, expert).path, cfg)
            raise ConfigError(f"weights lack layer(s) {[layers[i] for i in missing][:5]} of "
                              f"{name}" + (" (some experts)" if expert else ""))
    for expert in (False, True):
        for name in table.names(expert):
            weight = table.weight(name, expert)
            if weight.path in table.fused or (name, expert) not in collected:
                continue
            raw = collected[(name, expert)]
            pending.append(_Pending(weight.path, (raw,), functools.partial(weight.to_ours, cfg=cfg),
                                    2 if expert else 1, dtype_of(weight.path, raw)))
    for path, fused in table.fused.items():
        expert = fused.per_expert
        present = [part for part in fused.parts if (part, expert) in collected]
        if not present:
            continue  # absent from the config too, or reported as missing by _fill
        absent = [part for part in fused.parts if (part, expert) not in collected]
        if absent:
            raise ConfigError(f"weights in {folder} lack {', '.join(absent)} (of every layer)")
        raws = tuple(collected[(part, expert)] for part in fused.parts)

        def joined(*parts: Any, fused: Fused = fused) -> Any:
            return fused.join([fused.to_ours(name)(w, cfg)
                               for name, w in zip(fused.parts, parts, strict=True)], cfg, lead=0)

        pending.append(_Pending(path, raws, joined, 2 if expert else 1,
                                dtype_of(path, raws[0])))
    return pending


def _fill(model: Decoder, pending: list[_Pending], origin: Path, mesh: Mesh | None,
          on_device: bool) -> Decoder:
    graphdef, state = nnx.split(model)
    expected = {path: var for path, var in nnx.to_flat_state(state)}
    given = {p.path for p in pending}
    missing = sorted(".".join(p) for p in expected if p not in given)
    if missing:
        raise ConfigError(f"weights in {origin} lack: {', '.join(missing[:8])}")
    shapes = {}
    for item in pending:
        if item.path not in expected:
            raise ConfigError(f"weights in {origin} hold {'.'.join(item.path)}, which the config "
                              f"does not have (tie_word_embeddings?)")
        shape = tuple(item.raw[0].shape[:item.lead]) + item.slice_shape()
        want = expected[item.path].shape
        if shape != want:
            raise ConfigError(f"{'.'.join(item.path)} in {origin} has shape {shape}, "
                              f"config.json implies {tuple(want)}")
        shapes[item.path] = shape
    if on_device:
        # Several weights at once: each thread's transfers read their layers' pages of the
        # memory maps (the load's slow part on a GPU host), which run side by side.
        with concurrent.futures.ThreadPoolExecutor(LOAD_WORKERS,
                                                   thread_name_prefix="focus_jax_load") as pool:
            values = pool.map(lambda item: item.on_device(shapes[item.path]), pending)
            for item, value in zip(pending, values, strict=True):
                expected[item.path].set_value(_place(value, expected[item.path], mesh))
    else:
        for item in pending:
            value = item.on_host(shapes[item.path])
            expected[item.path].set_value(_place(value, expected[item.path], mesh))
    return nnx.merge(graphdef, state)


def save_safetensors(model: Decoder, folder: Path, max_shard_bytes: int = 15 << 20) -> list[Path]:
    """Write the weights as Hugging Face safetensors in the family's layout (sharded with an
    index when over ``max_shard_bytes``), what :func:`load_safetensors` reads."""
    from safetensors.flax import save_file

    cfg = model.config
    table = _table(cfg)
    _, state = nnx.split(model)
    flat = {path: var.get_value() for path, var in nnx.to_flat_state(state)}
    tensors: dict[str, jax.Array] = {}
    for key, weight in table.globals.items():
        if weight.path in flat:
            tensors[key] = weight.to_hf(flat[weight.path], cfg)
    for expert in (False, True):
        for name in table.names(expert):
            weight = table.weight(name, expert)
            if weight.path not in flat:
                continue
            stacked, fused = flat[weight.path], table.fused.get(weight.path)

            def torch_layout(value: jax.Array, name=name, weight=weight, fused=fused) -> jax.Array:
                return fused.part(value, name, cfg) if fused else weight.to_hf(value, cfg)

            for slot, layer in enumerate(stack_of(weight.path, cfg)):
                if expert:
                    for x in range(stacked.shape[1]):
                        tensors[f"model.layers.{layer}.{table.experts_prefix}.{x}.{name}"] = (
                            torch_layout(stacked[slot, x]))
                else:
                    tensors[f"model.layers.{layer}.{name}"] = torch_layout(stacked[slot])
    shards: list[dict[str, jax.Array]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].size * tensors[key].dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {key: name for name, shard in zip(names, shards, strict=True) for key in shard}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(folder / name))
    return [folder / name for name in names]
