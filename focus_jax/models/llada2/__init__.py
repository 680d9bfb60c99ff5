"""LLaDA2 mixture-of-experts decoders (LLaDA2.0 / 2.1, ``model_type`` ``llada2_moe``)."""

from focus_jax.models.family import Family
from focus_jax.models.llada2 import config, params

FAMILY = Family(
    name="llada2", model_types=config.MODEL_TYPES, config_from_hf=config.from_hf,
    config_to_hf=config.to_hf, key_table=params.KEY_TABLE, geometries=config.GEOMETRIES,
    default_mask_token_ids={"llada2_moe": config.MASK_TOKEN_ID})
