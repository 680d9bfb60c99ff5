"""Qwen3-MoE decoders (SDAR-MoE, Qwen3-MoE): ``config.json`` <-> :class:`ModelConfig`, presets.

Softmax top-k routing, no shared expert; a layer routes unless ``mlp_only_layers`` names it or
it is off ``decoder_sparse_step`` (layer ``i`` routes when ``(i + 1) % step == 0``), as in
transformers' ``Qwen3MoeDecoderLayer``.
"""

from __future__ import annotations

from typing import Any

from focus_jax.config import ConfigError, ModelConfig, MoEConfig, check_integer
from focus_jax.models.qwen3.config import SDAR_MASK_TOKEN_ID, common_fields, common_hf, require

MODEL_TYPES = ("sdar_moe", "qwen3_moe")

GEOMETRIES: dict[str, dict[str, Any]] = {
    # SDAR-30B-A3B-Chat's sizes (about 61 GB in bfloat16).
    "sdar-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, tie_word_embeddings=False, block_size=32,
        mask_token_id=SDAR_MASK_TOKEN_ID,
        moe=dict(num_experts=128, experts_per_token=8, expert_size=768, norm_topk_prob=True)),
}


def dense_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """The layers with a dense MLP, from ``decoder_sparse_step`` and ``mlp_only_layers``."""
    layers = raw["num_hidden_layers"]
    step = check_integer("decoder_sparse_step", raw.get("decoder_sparse_step", 1), minimum=1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < layers for i in only):
        raise ConfigError(f"mlp_only_layers must list layer indices below num_hidden_layers "
                          f"({layers}), got {only!r}")
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def from_hf(raw: dict[str, Any], dtype: str) -> ModelConfig:
    """A Qwen3-MoE ``config.json`` (``model_type`` ``sdar_moe`` or ``qwen3_moe``)."""
    require(raw, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    if raw.get("shared_expert_intermediate_size"):
        raise ConfigError("shared_expert_intermediate_size is set, but Qwen3-MoE has no shared "
                          "expert (is this a Qwen2-MoE checkpoint?)")
    fields = common_fields(raw)
    moe = MoEConfig(num_experts=raw["num_experts"], experts_per_token=raw["num_experts_per_tok"],
                    expert_size=raw["moe_intermediate_size"], dense_layers=dense_layers(raw),
                    scores="softmax", norm_topk_prob=bool(raw.get("norm_topk_prob", False)))
    return ModelConfig(**fields, moe=moe, dtype=dtype)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` dictionary that :func:`from_hf` reads back."""
    m = cfg.moe
    architecture = "SDARMoeForCausalLM" if cfg.model_type == "sdar_moe" else "Qwen3MoeForCausalLM"
    return {**common_hf(cfg, architecture), "num_experts": m.num_experts,
            "num_experts_per_tok": m.experts_per_token, "moe_intermediate_size": m.expert_size,
            "decoder_sparse_step": 1, "mlp_only_layers": list(m.dense_layers),
            "norm_topk_prob": m.norm_topk_prob}
