"""Qwen3-style dense decoders: SDAR (``model_type`` ``sdar``) and Qwen3 (``qwen3``)."""

from focus_jax.models.family import Family
from focus_jax.models.qwen3 import config, params

FAMILY = Family(
    name="qwen3", model_types=config.MODEL_TYPES, config_from_hf=config.from_hf,
    config_to_hf=config.to_hf, key_table=params.KEY_TABLE, geometries=config.GEOMETRIES,
    default_mask_token_ids={"sdar": config.SDAR_MASK_TOKEN_ID})
