"""Hugging Face safetensors -> NNX parameters for the Qwen3-style decoder.

One table maps each Hugging Face key to the NNX path it fills and the reshape that turns a torch
``Linear`` weight (``[out, in]``) into our einsum layout. Per-layer tensors are stacked on the
leading ``layers`` axis. Two of our weights are several Hugging Face tensors side by side
(:data:`_FUSED`): the query, key and value projections, and the MLP's gate and up projections.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
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
from focus_jax.models.qwen3 import Decoder

Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


def _linear(shape: Callable[[ModelConfig], tuple[int, ...]]) -> Transform:
    """A torch Linear weight ``[out, in]`` transposed to ``[in, ...out]``."""
    return lambda w, cfg: w.T.reshape(shape(cfg))


def _same(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w


_GLOBAL: dict[str, tuple[tuple[str, ...], Transform]] = {
    "model.embed_tokens.weight": (("embed",), _same),
    "model.norm.weight": (("norm", "weight"), _same),
    "lm_head.weight": (("lm_head",), lambda w, cfg: w.T),
}

@dataclasses.dataclass(frozen=True)
class _Fused:
    """One of our per-layer weights made of several Hugging Face tensors side by side on ``axis``
    of one layer's weight, in the order of ``parts``. ``sizes(cfg)``: each part's slices on
    that axis; ``shape(cfg, n)``: one layer's weight with ``n`` slices there."""

    axis: int
    parts: tuple[str, ...]
    sizes: Callable[[ModelConfig], tuple[int, ...]]
    shape: Callable[[ModelConfig, int], tuple[int, ...]]

    def part_transform(self, part: str) -> Transform:
        """A part's torch Linear weight ``[out, in]`` in our layout, ``[in, ...]``."""
        index = self.parts.index(part)

        def transform(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
            shape = self.shape(cfg, self.sizes(cfg)[index])
            if w.size != math.prod(shape):
                raise ConfigError(f"{part} has shape {tuple(w.shape)}, config.json implies "
                                  f"{math.prod(shape[1:])} x {shape[0]}")
            return w.T.reshape(shape)

        return transform

    def join(self, parts: list[np.ndarray], cfg: ModelConfig) -> np.ndarray:
        """The stacked fused weight ``[L, ...]`` from its stacked parts, in the order of
        ``parts``, each ``[L, ...]`` in any layout of its size (``q_proj [L, E, H, D]``)."""
        return np.concatenate(
            [part.reshape(part.shape[0], *self.shape(cfg, size))
             for part, size in zip(parts, self.sizes(cfg), strict=True)], axis=self.axis + 1)


_FUSED: dict[tuple[str, ...], _Fused] = {
    # [E, KVH, G + 2, D]: per KV head its G query heads, then its key and its value.
    ("attn", "qkv_proj"): _Fused(
        2, ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        lambda c: (c.num_heads // c.num_kv_heads, 1, 1),
        lambda c, n: (c.hidden_size, c.num_kv_heads, n, c.head_dim)),
    # [E, 2, F].
    ("mlp", "gate_up_proj"): _Fused(
        1, ("mlp.gate_proj.weight", "mlp.up_proj.weight"), lambda c: (1, 1),
        lambda c, n: (c.hidden_size, n, c.intermediate_size)),
}

_PER_LAYER: dict[str, tuple[tuple[str, ...], Transform]] = {
    "input_layernorm.weight": (("input_norm", "weight"), _same),
    "post_attention_layernorm.weight": (("post_attn_norm", "weight"), _same),
    "self_attn.o_proj.weight": (
        ("attn", "o_proj"), _linear(lambda c: (c.num_heads, c.head_dim, c.hidden_size))),
    "self_attn.q_norm.weight": (("attn", "q_norm", "weight"), _same),
    "self_attn.k_norm.weight": (("attn", "k_norm", "weight"), _same),
    "mlp.down_proj.weight": (("mlp", "down_proj"), lambda w, cfg: w.T),
    **{part: (path, fused.part_transform(part))
       for path, fused in _FUSED.items() for part in fused.parts},
}


def _separate_name(part: str) -> str:
    """The name a fused weight's part had as a weight of its own (``q_proj``, ``gate_proj``)."""
    return part.split(".")[-2]


def has_separate_projections(layers: Any) -> bool:
    """``layers`` (a params tree's ``layers`` part, or its metadata) holds the fused weights'
    parts as separate weights, as folders converted before the fusion do."""
    return any(_separate_name(fused.parts[0]) in layers[path[0]] for path, fused in _FUSED.items())


def fuse_separate_projections(layers: dict, cfg: ModelConfig) -> dict:
    """``layers`` with separate stacked parts (``q_proj [L, E, H, D]``, ``k_proj``, ...,
    ``gate_proj [L, E, F]``) replaced, in place, by our fused weights."""
    for (module, name), fused in _FUSED.items():
        parts = [np.asarray(layers[module].pop(_separate_name(part))) for part in fused.parts]
        layers[module][name] = fused.join(parts, cfg)
    return layers


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


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
           "BOOL": np.bool_}


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


def abstract_decoder(cfg: ModelConfig) -> Decoder:
    """The decoder's structure with shapes only, nothing allocated."""
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))


def load_safetensors(folder: Path, cfg: ModelConfig, mesh: Mesh | None = None) -> Decoder:
    """Build the decoder from a Hugging Face folder's safetensors weights, cast to ``cfg.dtype``:
    on the default device, or each tensor straight into its shards of ``mesh`` (from host
    memory: no device holds more of a tensor than its own shard)."""
    dtype = np.dtype(cfg.jnp_dtype)
    flat: dict[tuple[str, ...], np.ndarray] = {}
    per_layer: dict[str, list[np.ndarray | None]] = {}
    for file in safetensors_files(folder):
        for key, tensor in read_safetensors(file).items():
            match = _LAYER_KEY.fullmatch(key)
            if match:
                index, name = int(match.group(1)), match.group(2)
                if name not in _PER_LAYER or index >= cfg.num_layers:
                    raise ConfigError(f"unexpected tensor {key!r} in {file.name}")
                slots = per_layer.setdefault(name, [None] * cfg.num_layers)
                slots[index] = _PER_LAYER[name][1](tensor, cfg).astype(dtype)
            elif key in _GLOBAL:
                path, transform = _GLOBAL[key]
                flat[path] = transform(tensor, cfg).astype(dtype)
            else:
                raise ConfigError(f"unexpected tensor {key!r} in {file.name}")
    for name, slots in per_layer.items():
        missing = [i for i, s in enumerate(slots) if s is None]
        if missing:
            raise ConfigError(f"weights lack layer(s) {missing[:5]} of {name}")
    for name, (path, _) in _PER_LAYER.items():
        if path not in _FUSED and name in per_layer:
            flat[("layers", *path)] = np.stack(per_layer[name])
    for path, fused in _FUSED.items():
        absent = [part for part in fused.parts if part not in per_layer]
        if absent:
            raise ConfigError(f"weights in {folder} lack {', '.join(absent)} (of every layer)")
        flat[("layers", *path)] = fused.join([np.stack(per_layer[part]) for part in fused.parts],
                                             cfg)
    if cfg.tie_word_embeddings:
        flat.pop(("lm_head",), None)
    return _fill(abstract_decoder(cfg), flat, folder, mesh)


def _fill(model: Decoder, flat: dict[tuple[str, ...], np.ndarray], origin: Path,
          mesh: Mesh | None = None) -> Decoder:
    graphdef, state = nnx.split(model)
    expected = {path: var for path, var in nnx.to_flat_state(state)}
    missing = sorted(".".join(p) for p in expected if p not in flat)
    if missing:
        raise ConfigError(f"weights in {origin} lack: {', '.join(missing[:8])}")
    for path, value in flat.items():
        if path not in expected:
            raise ConfigError(f"weights in {origin} hold {'.'.join(path)}, which the config "
                              f"does not have (tie_word_embeddings?)")
        want = expected[path].shape
        if value.shape != want:
            raise ConfigError(f"{'.'.join(path)} in {origin} has shape {tuple(value.shape)}, "
                              f"config.json implies {tuple(want)}")
        expected[path].set_value(_place(value, expected[path], mesh))
    return nnx.merge(graphdef, state)


def _place(value: np.ndarray, var: nnx.Variable, mesh: Mesh | None) -> jax.Array:
    """A host tensor on the default device, or on ``mesh`` with its parameter's sharding, each
    device given only its own slice of it (this process's devices: the others load theirs)."""
    if mesh is None:
        return jnp.asarray(value)
    where = sharding.param_sharding(var, mesh)
    return jax.make_array_from_callback(value.shape, where, lambda index: value[index])


def _part(value: jax.Array, path: tuple[str, ...], name: str, cfg: ModelConfig) -> jax.Array:
    """The Hugging Face tensor ``name``'s part of one layer's weight ``value`` at ``path`` (the
    whole weight unless it is fused)."""
    if path not in _FUSED:
        return value
    fused = _FUSED[path]
    sizes = fused.sizes(cfg)
    where = fused.parts.index(name)
    start = sum(sizes[:where])
    return jax.lax.slice_in_dim(value, start, start + sizes[where], axis=fused.axis)


def _to_torch_layout(value: jax.Array, path: tuple[str, ...]) -> jax.Array:
    """The inverse of the table's transforms: our einsum layout back to ``[out, in]``."""
    name = path[-1]
    if name in ("qkv_proj", "gate_up_proj"):  # one part: [in, ...out]
        return value.reshape(value.shape[0], -1).T
    if name == "o_proj":
        return value.reshape(value.shape[0] * value.shape[1], -1).T
    if name in ("down_proj", "lm_head"):
        return value.T
    return value


def save_safetensors(model: Decoder, folder: Path, max_shard_bytes: int = 15 << 20) -> list[Path]:
    """Write the weights as Hugging Face safetensors (sharded with an index when over
    ``max_shard_bytes``), the layout :func:`load_safetensors` reads."""
    from safetensors.flax import save_file

    _, state = nnx.split(model)
    flat = {path: var.get_value() for path, var in nnx.to_flat_state(state)}
    tensors: dict[str, jax.Array] = {}
    for key, (path, _) in _GLOBAL.items():
        if path in flat:
            tensors[key] = _to_torch_layout(flat[path], path)
    for name, (path, _) in _PER_LAYER.items():
        stacked = flat[("layers", *path)]
        for index in range(stacked.shape[0]):
            tensors[f"model.layers.{index}.{name}"] = _to_torch_layout(
                _part(stacked[index], path, name, model.config), path)
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
