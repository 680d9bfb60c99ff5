"""Grouped matmul as tokamax's Mosaic ragged-dot kernels (``pip install tokamax==0.0.17``).

- NVIDIA Hopper GPUs: tokamax's Pallas Mosaic GPU kernel (its ``mosaic_gpu`` implementation,
  wgmma tiles fed by the bulk tensor copy engine). bf16 or f16, both operands of one dtype,
  ``k`` and ``n`` multiples of 64. On the H200 at expert shapes: 14-39 TFLOP/s at 2,048 rows,
  57-113 at 8,192, 158-229 at 65,536, where XLA's ragged dot reaches 2.7-5.8
  (``docs/kernels.md``).
- TPUs from v5 on: tokamax's GMM v2 (``mosaic_tpu_v2``), bf16. It compiles for v5e, v6e and
  v5p at row counts that are no multiple of 128 and at ``k`` and ``n`` below 128
  (``tests/test_tpu_kernels.py``); it has never run here (no TPU, and the Pallas TPU
  interpreter cannot run it: "Unsupported memory space: smem"). In float32 its tiling outgrows
  a v5p's VMEM at SDAR-30B-A3B's gate-up projection (70.5 of 63.9 MiB), so float32 stays with
  XLA. tokamax's v1 kernel (``mosaic_tpu``) and JAX's megablox ``gmm`` refuse row counts that
  are not a multiple of their 128-row tile (v1 also any dimension under 128).

Neither kernel writes the rows past ``sum(group_sizes)``: the GPU kernel never visits them, and
GMM v2 zeros them only with ``zero_initialize``, in DMAs of its own. The output is masked here
instead (one elementwise select, which XLA can fuse into the consumer), so padding rows are
zeros, as in the reference.

On the GPU, a tile config tuned on that GPU at our expert shapes is used where the table of
``tuned/<device kind>.json`` has the shape (``scripts/tune_grouped_matmul.py`` measures and writes
it; the config of the nearest tuned row count); elsewhere tokamax's own choice (on Hopper a
heuristic: 64 x 64 tiles, two stages; tokamax 0.0.17 ships tuned configs for other GPUs and
shapes only).

Never tokamax's Triton implementation: it fails with jax-triton 0.3.1. tokamax is imported on
first use, not with this module: it imports xprof, qwix and flax at import time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import qwix
from jaxtyping import Array, Float, Int

from pallas_kernels.grouped_matmul.reference import valid_rows

GPU_DTYPES = (jnp.bfloat16, jnp.float16)
TPU_DTYPES = (jnp.bfloat16,)
KERNEL = {"gpu": "mosaic_gpu", "tpu": "mosaic_tpu_v2"}
"""tokamax's implementation name for each platform."""
GPU_ROW_TILE = 8
"""The Mosaic GPU kernel's output copies take whole 8-row tiles ("dimension 0 must have size
smaller or a multiple of its tiling 8"): other row counts are padded with padding rows."""
GPU_TILE = 64
"""The Mosaic GPU kernel's copies of ``lhs``, ``rhs`` and the output move 128-byte swizzled
rows (64 bf16 elements): on the H200 ``k = 96`` and ``k = 200`` fail to lower, and so does
``n = 48`` with a float32 output. ``k`` and ``n`` must be multiples of 64 (every expert
projection is)."""
FP8_TO_BF16_PTX_ISA = 92
"""tokamax's Hopper kernel for 8-bit weights converts them to the rows' dtype in registers.
Mosaic GPU converts FP8 to bfloat16 only where ptxas speaks PTX ISA 9.2 (CUDA 13.x); older ones
convert FP8 to float16 only ("Hardware has no support for converting from f8E4M3FN to bf16",
on an H100 with the H200 image's CUDA, 2026-12-07)."""


TUNED = Path(__file__).parent / "tuned"
"""One JSON table per GPU kind (``device_kind`` lower-cased, spaces as ``_``): per expert shape
(:func:`shape_key`), the fastest measured config at each tuned row count."""


def shape_key(k: int, n: int, groups: int, weights: str | None = None) -> str:
    """A tuned table's key: ``"{k}x{n}x{groups}"`` for 16-bit weights, ``":int8"`` (the 8-bit
    weights' dtype) appended for tokamax's kernel of 8-bit weights, a kernel of its own."""
    return f"{k}x{n}x{groups}" + (f":{weights}" if weights else "")


def parse_shape_key(key: str) -> tuple[int, int, int, str | None]:
    """``(k, n, groups, weights)`` of a :func:`shape_key`."""
    shape, _, weights = key.partition(":")
    k, n, groups = map(int, shape.split("x"))
    return k, n, groups, weights or None


@functools.cache
def installed() -> bool:
    return importlib.util.find_spec("tokamax") is not None


def unsupported(lhs: jax.ShapeDtypeStruct | Array, rhs: jax.ShapeDtypeStruct | Array,
                platform: str) -> str | None:
    """Why these kernels cannot multiply ``lhs [m, k]`` by ``rhs [g, k, n]`` (their shapes and
    dtypes) on ``platform`` (None: they can). ``platform``: ``"gpu"`` (this process's first GPU
    is asked for its generation), ``"tpu"`` (the chip of the abstract mesh in context, else
    this process's TPU), or any other."""
    if platform not in KERNEL:
        return f"tokamax's Mosaic kernels run on NVIDIA Hopper GPUs and TPUs, not on {platform}"
    if not installed():
        return "tokamax is not installed (pip install tokamax==0.0.17)"
    if lhs.dtype != rhs.dtype:
        return f"lhs and rhs must have one dtype (got {lhs.dtype} and {rhs.dtype})"
    dtypes = GPU_DTYPES if platform == "gpu" else TPU_DTYPES
    if lhs.dtype not in dtypes:
        names = " or ".join(jnp.dtype(d).name for d in dtypes)
        return (f"on {platform.upper()}s tokamax's kernel takes {names}, not "
                f"{jnp.dtype(lhs.dtype).name}")
    if platform == "tpu":
        return _tpu_unsupported()
    _, k, n = rhs.shape
    if k % GPU_TILE or n % GPU_TILE:
        return f"on GPUs k and n must be multiples of {GPU_TILE} (got k={k}, n={n})"
    if why := _gpu_unsupported():
        return why
    if isinstance(rhs, qwix.QArray):
        return fp8_weights_unsupported(lhs.dtype, rhs.qvalue.dtype, _ptxas_isa_version())
    return None


def fp8_weights_unsupported(lhs_dtype: jnp.dtype, weight_dtype: jnp.dtype,
                            ptx_isa: int) -> str | None:
    """Why tokamax's Hopper kernel cannot take 8-bit weights of ``weight_dtype`` with rows of
    ``lhs_dtype`` where ptxas speaks PTX ISA ``ptx_isa`` (e.g. 88 for 8.8); None: it can."""
    fp8 = jnp.issubdtype(weight_dtype, jnp.floating) and jnp.dtype(weight_dtype).itemsize == 1
    if not fp8 or jnp.dtype(lhs_dtype) == jnp.float16 or ptx_isa >= FP8_TO_BF16_PTX_ISA:
        return None
    def isa(version: int) -> str:
        return f"{version // 10}.{version % 10}"

    return (f"tokamax's Hopper kernel converts FP8 weights to the rows' "
            f"{jnp.dtype(lhs_dtype).name} in registers, which this CUDA's ptxas (PTX ISA "
            f"{isa(ptx_isa)}) cannot (it converts FP8 to float16 only; ISA "
            f"{isa(FP8_TO_BF16_PTX_ISA)} can); int8 weights keep the kernel")


@functools.cache
def _ptxas_isa_version() -> int:
    """The PTX ISA version of the ptxas that Mosaic GPU compiles with (92 for 9.2); 0 where JAX
    does not say (a private API that may move: then FP8 weights take XLA's ragged dot)."""
    try:
        from jax._src.lib import mosaic_gpu

        return int(mosaic_gpu._mosaic_gpu_ext._get_ptxas_isa_version())
    except Exception:  # any failure means "unknown"
        return 0


@functools.cache
def _gpu_unsupported() -> str | None:
    device = jax.devices("gpu")[0]
    capability = getattr(device, "compute_capability", None)
    if capability is None or not str(capability).startswith("9."):
        return (f"tokamax's Mosaic GPU ragged dot is used on Hopper GPUs (compute capability "
                f"9.x), not on this {device.device_kind} ({capability})")
    return None


def _tpu_unsupported() -> str | None:
    from jax.experimental.pallas import tpu as pltpu

    try:
        generation = pltpu.get_tpu_info().generation
    except ValueError as err:  # a chip JAX does not know
        return str(err).splitlines()[0]
    return None if generation >= 5 else f"tokamax's GMM v2 needs a TPU v5 or newer (got v{generation})"


class _NoAutotuningMisses(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Autotuning cache miss")


@functools.cache
def _quiet_autotuning_misses() -> None:
    """tokamax logs a multi-line warning through absl for every shape it has no tuned config
    for (each compaction bucket of every layer shape: 36 lines per MoE round compiled on an
    H200); it then runs its default config, and nobody can act on the warning."""
    logging.getLogger("absl").addFilter(_NoAutotuningMisses())


def _one_pass(dtype: jnp.dtype) -> contextlib.AbstractContextManager:
    """16-bit operands: one pass of exact products with float32 sums, all these kernels have.
    Both refuse the float32 contract precision that ``jax_default_matmul_precision="highest"``
    asks for, and GMM v2 ignores its ``precision`` argument (its dots take the configured
    default), so the default is set around the call. Float32: as configured."""
    if jnp.dtype(dtype).itemsize == 4:
        return contextlib.nullcontext()
    return jax.default_matmul_precision("default")


@functools.cache
def tuned_table(device_kind: str) -> dict[str, list[dict]]:
    """The tuned configs of one GPU kind (empty where none were measured)."""
    path = TUNED / f"{device_kind.lower().replace(' ', '_')}.json"
    return json.loads(path.read_text())["shapes"] if path.exists() else {}


def tuned_config(device_kind: str, rows: int, k: int, n: int, groups: int,
                 weights: str | None = None) -> dict | None:
    """The tuned config (tokamax ``Config`` fields) for ``rows x k`` times ``[groups, k, n]``
    (``weights``: the 8-bit weights' dtype name, None for 16-bit weights) on this GPU kind:
    that of the tuned row count nearest ``rows`` (by ratio); None where the shape was not
    tuned there."""
    entries = tuned_table(device_kind).get(shape_key(k, n, groups, weights))
    if not entries:
        return None
    return min(entries, key=lambda e: abs(math.log(e["rows"] / max(rows, 1))))["config"]


def op(config: dict):
    """tokamax's Mosaic GPU ragged-dot op with a fixed tile config (its ``Config`` fields).
    Imported from tokamax's own module: ``tokamax.ops.gpu``, which re-exports it, also imports
    its Triton ops and with them jax-triton."""
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config, PallasMosaicGpuRaggedDot

    return PallasMosaicGpuRaggedDot(config=Config(**config))


def _implementation(lhs: Array, rhs: Array | qwix.QArray, platform: str):
    """The tuned op where this GPU and shape (and 8-bit weight dtype) were tuned, else the
    name of tokamax's implementation for the platform."""
    if platform == "gpu":
        groups, k, n = rhs.shape
        weights = jnp.dtype(rhs.qvalue.dtype).name if isinstance(rhs, qwix.QArray) else None
        config = tuned_config(jax.devices("gpu")[0].device_kind, lhs.shape[0], k, n, groups,
                              weights)
        if config is not None:
            return [op(config)]
    return KERNEL[platform]


def grouped_matmul(lhs: Float[Array, "m k"], rhs: Float[Array, "g k n"] | qwix.QArray,
                   group_sizes: Int[Array, "g"], *, platform: str,
                   preferred_element_type: jnp.dtype | None = None) -> Float[Array, "m n"]:
    """Contract in :func:`pallas_kernels.grouped_matmul.reference.grouped_matmul`; ``platform``
    (``"gpu"`` or ``"tpu"``) picks the kernel. Callers check :func:`unsupported` first."""
    import tokamax

    _quiet_autotuning_misses()

    group_sizes = group_sizes.astype(jnp.int32)
    rows = lhs.shape[0]
    padded = -rows % GPU_ROW_TILE if platform == "gpu" else 0
    lhs = jnp.pad(lhs, ((0, padded), (0, 0))) if padded else lhs
    out_dtype = preferred_element_type
    if platform == "gpu" and isinstance(rhs, qwix.QArray) and out_dtype is not None \
            and jnp.dtype(out_dtype).itemsize > 2:
        # tokamax's Hopper kernel for 8-bit weights writes its output tiles through a 128-byte
        # swizzle as wide as its 64-column tile: 16-bit outputs only (a float32 tile fails with
        # "out_swizzle_elems=32 must equal block_n=64"). It accumulates in float32 all the same;
        # only the written product is rounded.
        out_dtype = lhs.dtype
    with _one_pass(lhs.dtype):
        out = tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype,
                                 implementation=_implementation(lhs, rhs, platform))
    out = out.astype(preferred_element_type) if preferred_element_type is not None else out
    return jnp.where(valid_rows(group_sizes, rows + padded)[:, None], out, 0)[:rows]
