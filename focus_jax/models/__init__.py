"""Model families, a folder each: its ``config.json`` reader, presets and checkpoint key table,
all building the shared decoder (:mod:`focus_jax.models.decoder`) that the decoding step uses
through a small protocol.

| family | ``model_type`` | feed-forward |
|---|---|---|
| :mod:`~focus_jax.models.qwen3` | ``sdar``, ``qwen3`` | dense SwiGLU |
| :mod:`~focus_jax.models.qwen3_moe` | ``sdar_moe``, ``qwen3_moe`` | softmax top-k experts |
| :mod:`~focus_jax.models.llada2` | ``llada2_moe`` | sigmoid group-limited experts + shared |
"""

from __future__ import annotations

from typing import Any

from focus_jax.config import ConfigError, ModelConfig, MoEConfig
from focus_jax.models import llada2, qwen3, qwen3_moe
from focus_jax.models.family import Family

FAMILIES: tuple[Family, ...] = (qwen3.FAMILY, qwen3_moe.FAMILY, llada2.FAMILY)
_BY_MODEL_TYPE = {model_type: f for f in FAMILIES for model_type in f.model_types}
SUPPORTED_MODEL_TYPES = tuple(_BY_MODEL_TYPE)


def family(model_type: Any) -> Family:
    """The family that reads ``model_type``; a one-line error for any other."""
    if model_type not in _BY_MODEL_TYPE:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return _BY_MODEL_TYPE[model_type]


GEOMETRIES: dict[str, tuple[str, dict[str, Any]]] = {
    name: (f.model_types[0], fields) for f in FAMILIES for name, fields in f.geometries.items()}
"""Every family's named geometries: name -> (its first ``model_type``, its fields)."""


def geometry(name: str, dtype: str = "bfloat16") -> ModelConfig:
    """A named geometry's config (``sdar-8b``, ...), for random-weight benchmarks."""
    if name not in GEOMETRIES:
        raise ConfigError(f"unknown geometry {name!r}; choose from {', '.join(sorted(GEOMETRIES))}")
    model_type, fields = GEOMETRIES[name]
    fields = dict(fields)
    if "moe" in fields:
        fields["moe"] = MoEConfig(**fields["moe"])
    return ModelConfig(**fields, model_type=model_type, dtype=dtype)
