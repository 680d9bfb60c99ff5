"""8-bit weights for a loaded model (``focus_jax.load(path, quantize="int8")``), and where each
kind of quantization can run.

A quantized model is built from its config (:class:`~focus_jax.config.Quantization` in
``ModelConfig.quantization``): its projections' and experts' weights are qwix ``QArray``s
(:mod:`focus_jax.models.matmul`). :func:`quantize` fills that structure from a model's plain
weights, one weight at a time, with qwix's quantizer. qwix's own PTQ path
(``qwix.quantize_model`` with a ``PtqProvider``) cannot do it for these models: it quantizes a
weight when an intercepted ``einsum`` inside a module's method sees it, and replaces the
module's attribute then; our layers run inside ``lax.scan`` / ``fori_loop`` over weights
stacked on a ``layers`` axis, so it sees one layer's slice of a stacked parameter (with the
stack's five logical axis names for a four-axis slice: an ``AssertionError`` in
``qwix._src.utils.flax_util.update_sharding``, docs/quantization.md), and the module it would
update is the per-layer view merged inside the loop, not the stack.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from focus_jax import sharding
from focus_jax.config import ConfigError, Quantization
from focus_jax.model import Model
from focus_jax.models import matmul
from focus_jax.models.weights import abstract_decoder

FP8_COMPUTE_CAPABILITY = (8, 9)
"""NVIDIA GPUs with FP8 tensor cores: Ada (8.9) and Hopper (9.0) on."""


def as_quantization(quantize: str | Quantization | None) -> Quantization | None:
    """``"int8"`` / ``"fp8"`` (weights only), a :class:`Quantization`, or None."""
    if quantize is None or isinstance(quantize, Quantization):
        return quantize
    return Quantization(quantize)


def check_platform(quantization: Quantization | None, platform: str,
                   device: jax.Device | None = None) -> None:
    """A ``ConfigError`` where ``quantization`` cannot run as asked on ``platform`` (``cpu``,
    ``gpu``, ``tpu``; ``device``: a GPU to ask for its generation).

    8-bit weights run everywhere (dequantized in the matmul). 8-bit activations are refused
    where no 8-bit matmul is known to beat the dequantized one: FP8 needs FP8 tensor cores
    (NVIDIA compute capability 8.9 or newer; no TPU before v7 has FP8 matrix units), and CPUs
    are refused both (they compute them correctly, as the tests do through :func:`quantize`,
    but nothing shows them faster there). Nothing falls back silently."""
    if quantization is None or quantization.activations_from is None:
        return
    kind = quantization.weights
    drop = (f"leave out the activations' quantization: {kind} weights alone run on any "
            f"platform, dequantized in the matmul")
    if platform == "cpu":
        raise ConfigError(f"{kind} activations are not served on CPUs (no 8-bit matmul there "
                          f"is known to beat the dequantized one); {drop}")
    if kind == "fp8" and platform == "tpu":
        raise ConfigError(f"fp8 activations need FP8 matrix units, which TPUs before v7 lack; "
                          f"use int8, or {drop}")
    if kind == "fp8" and platform == "gpu":
        device = device or jax.devices("gpu")[0]
        capability = tuple(int(p) for p in str(getattr(device, "compute_capability", "0.0"))
                           .split(".")[:2])
        if capability < FP8_COMPUTE_CAPABILITY:
            raise ConfigError(f"fp8 activations need FP8 tensor cores (compute capability 8.9 "
                              f"or newer), not this {device.device_kind} ({capability}); {drop}")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_weight(value: jax.Array, contracted: tuple[int, ...], weights: str):
    q = matmul.quantize(value, contracted, weights)
    return q.qvalue, q.scale


def quantize(model: Model, quantization: str | Quantization, mesh: Mesh | None = None) -> Model:
    """``model`` with 8-bit weights (``"int8"``, ``"fp8"`` or a :class:`Quantization`), each
    quantized per output channel from its plain weight, on ``mesh`` when given. A model already
    quantized to the same weights gets the new activation setting; to other weights, a
    ``ConfigError`` (quantize the unquantized checkpoint instead)."""
    quantization = as_quantization(quantization)
    cfg = model.config.replace(quantization=quantization)
    graphdef, target = nnx.split(abstract_decoder(cfg))
    current = model.config.quantization
    if current is not None:
        if current.weights != quantization.weights:
            raise ConfigError(f"the model's weights are already {current.weights}; load the "
                              f"unquantized checkpoint to quantize it to {quantization.weights}")
        return Model(cfg, graphdef, model.params, model.tokenizer, model.stop_token_ids)
    plain = dict(nnx.to_flat_state(model.params))
    slots = dict(nnx.to_flat_state(target))
    for path, var in slots.items():
        if path in plain:
            var.set_value(plain[path].get_value())
        elif path[-1] == "qvalue":
            name = path[:-1]
            scale = slots[(*name, "scale")]
            contracted = tuple(i for i, (n, s) in enumerate(zip(var.shape, scale.shape,
                                                                 strict=True)) if s < n)
            qvalue, scales = _quantize_weight(plain[name].get_value(), contracted,
                                              quantization.weights)
            var.set_value(qvalue)
            scale.set_value(scales)
    if mesh is not None:
        target = sharding.shard_params(target, mesh)
    return Model(cfg, graphdef, target, model.tokenizer, model.stop_token_ids)
