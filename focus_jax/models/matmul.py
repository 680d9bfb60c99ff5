"""Every product of activations with a layer's weights, in one place, for plain and 8-bit
weights.

The projections of attention and MLPs, the LM head and the experts' grouped matmuls all call
:func:`project` or :func:`grouped`, so that what a weight is (its dtype, its layout) is decided
here and nowhere in the layers. A weight (:func:`weight`) is a parameter, or in a quantized
model (:class:`~focus_jax.config.Quantization`) a qwix ``QArray`` of two parameters:

- ``qvalue``: the weight's shape, ``int8`` or ``float8_e4m3fn``;
- ``scale``: the model's dtype, the weight's shape with 1 on the axes the matmul contracts: one
  scale per output channel (and per layer of a stack, per expert), symmetric (absolute maximum
  over the contracted axes), so that ``weight ~= qvalue * scale``.

With plain activations the weight's 8-bit values enter the matmul converted to the
activations' dtype and the scale multiplies the product's output channels (so that XLA can
fuse the convert into its GEMM rather than write a dequantized copy of each layer's weight,
which qwix's dequantize-then-multiply made it do on the H200); with 8-bit activations
(``activations_from``) both operands are 8-bit (``qwix.einsum``) and the scales multiply the
product. The experts' grouped matmul takes qwix's ``ragged_dot`` through its backends.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from focus_jax.config import Quantization
from pallas_kernels.dispatch import target_platform
from pallas_kernels.grouped_matmul import grouped_matmul

QTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
"""Each quantized weight type's storage dtype."""

Weight = nnx.Param | qwix.QArray
"""A weight as a module holds it: a parameter, or a ``QArray`` of two parameters."""


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter with logical axis names (placed by :mod:`focus_jax.sharding`)."""
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def quantize(value: Float[Array, "..."], contracted: tuple[int, ...],
             weights: str) -> qwix.QArray:
    """``value`` in 8 bits (``weights``: ``int8`` or ``fp8``) with a symmetric scale per slice
    along the axes not in ``contracted``."""
    kept = tuple(axis for axis in range(value.ndim) if axis not in contracted)
    return qwix.quantize(value, QTYPES[weights], channelwise_axes=kept)


def weight(value: Float[Array, "..."], axes: tuple[str, ...], contracted: tuple[str, ...],
           quantization: Quantization | None) -> Weight:
    """A matmul's weight ``value`` with logical axis names ``axes``, of which the matmul
    contracts ``contracted``: a parameter, or with ``quantization`` a ``QArray`` of parameters
    (the scale's contracted axes unnamed: they have size 1)."""
    if quantization is None:
        return param(value, axes)
    where = tuple(i for i, name in enumerate(axes) if name in contracted)
    q = quantize(value, where, quantization.weights)
    scale_axes = tuple(None if name in contracted else name for name in axes)
    return qwix.QArray(qvalue=param(q.qvalue, axes), scale=param(q.scale, scale_axes),
                       qtype=q.qtype)


def read(w: Weight) -> Array | qwix.QArray:
    """The arrays of a weight as a module holds it."""
    if isinstance(w, qwix.QArray):
        return qwix.QArray(qvalue=w.qvalue[...], scale=w.scale[...], qtype=w.qtype)
    return w[...]


def weight_partition(w: Array | qwix.QArray, partition: PartitionSpec) -> PartitionSpec | qwix.QArray:
    """``partition`` for a weight's arrays: a quantized weight's scale is not split on the axes
    where it has size 1 (those the matmul contracts)."""
    if not isinstance(w, qwix.QArray):
        return partition
    axes = tuple(partition) + (None,) * (w.ndim - len(partition))
    scale = PartitionSpec(*(None if s == 1 else a for a, s in zip(axes, w.scale.shape,
                                                                    strict=True)))
    return qwix.QArray(qvalue=partition, scale=scale, qtype=w.qtype)


def _contracted_suffix(spec: str) -> int:
    """How many trailing axes of the activations ``spec`` contracts (``"...hd,hde->...e"``:
    2)."""
    inputs, output = spec.replace(" ", "").split("->")
    activations = inputs.split(",")[0].replace("...", "")
    return sum(1 for name in activations if name not in output)


def project(spec: str, x: Float[Array, "..."], w: Weight, quantization: Quantization | None = None,
            *, preferred_element_type: jnp.dtype | None = None) -> Float[Array, "..."]:
    """``einsum(spec, x, w)``: activations ``x`` times the weight ``w`` (``spec`` names the
    activations first and contracts their trailing axes, e.g. ``"...e,ef->...f"``).

    With a quantized weight and ``quantization.activations_from`` at most the activations' rows
    (every axis but the contracted ones), ``x`` is quantized per row to the weight's type first
    (FP8 x FP8 or int8 x int8 products); otherwise the weight is dequantized into the product.
    """
    w = read(w)
    if not isinstance(w, qwix.QArray):
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    contracted = _contracted_suffix(spec)
    rows = math.prod(x.shape[:x.ndim - contracted])
    if (quantization is not None and quantization.activations_from is not None
            and rows >= quantization.activations_from):
        x = qwix.quantize(x, w.qtype, channelwise_axes=tuple(range(x.ndim - contracted)))
        return qwix.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    return _scaled_after(spec, x, w, preferred_element_type)


def _scaled_after(spec: str, x: Float[Array, "..."], w: qwix.QArray,
                  preferred_element_type: jnp.dtype | None) -> Float[Array, "..."]:
    """``einsum(spec, x, qvalue * scale)`` as ``einsum(spec, x, qvalue) * scale``: the scale is
    constant along the contracted axes, so it multiplies the product's output channels instead
    of the weight. The weight enters the matmul as its 8-bit values converted to the
    activations' dtype (exact for int8 and FP8 e4m3 in bfloat16; float32 on CPUs), which XLA can
    fuse into its GEMM, so that no dequantized copy of the weight is written; the product accumulates in
    float32 and is scaled there."""
    inputs, output = spec.replace(" ", "").split("->")
    weight_axes = inputs.split(",")[1]
    kept = "".join(name for name in weight_axes if name in output)
    scale = w.scale.reshape([n for name, n in zip(weight_axes, w.scale.shape, strict=True)
                             if name in kept])
    # XLA's CPU runtime has no bf16 x bf16 -> f32 GEMM ("Unsupported element type for
    # DotThunk::Execute"): there both operands go in as float32 (exact for bf16 activations and
    # 8-bit values).
    dtype = jnp.float32 if target_platform() == "cpu" else x.dtype
    product = jnp.einsum(spec, x.astype(dtype), w.qvalue.astype(dtype),
                         preferred_element_type=jnp.float32)
    out_dtype = preferred_element_type or jnp.result_type(x.dtype, w.scale.dtype)
    return jnp.einsum(f"{output},{kept}->{output}", product,
                      scale.astype(jnp.float32)).astype(out_dtype)


def grouped(x: Float[Array, "m k"], w: Float[Array, "g k n"] | qwix.QArray,
            group_sizes: Int[Array, "g"], *,
            preferred_element_type: jnp.dtype | None = None) -> Float[Array, "m n"]:
    """Rows of ``x`` sorted by group times their group's weight ``w[g]`` (the experts'
    matmul, :func:`pallas_kernels.grouped_matmul.grouped_matmul`; a quantized ``w`` runs
    weights only)."""
    return grouped_matmul(x, w, group_sizes, preferred_element_type=preferred_element_type)
