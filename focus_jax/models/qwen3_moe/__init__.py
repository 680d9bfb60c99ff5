"""Qwen3-MoE decoders: SDAR-MoE (``model_type`` ``sdar_moe``) and Qwen3-MoE (``qwen3_moe``)."""

from focus_jax.models.family import Family
from focus_jax.models.qwen3.config import SDAR_MASK_TOKEN_ID
from focus_jax.models.qwen3_moe import config, params

FAMILY = Family(
    name="qwen3_moe", model_types=config.MODEL_TYPES, config_from_hf=config.from_hf,
    config_to_hf=config.to_hf, key_table=params.KEY_TABLE, geometries=config.GEOMETRIES,
    default_mask_token_ids={"sdar_moe": SDAR_MASK_TOKEN_ID})
