"""LLaDA2 mixture-of-experts decoders (LLaDA2.0 / 2.1, ``model_type`` ``llada2_moe``):
``config.json`` <-> :class:`ModelConfig`, presets.

The checkpoints ship remote code; focus_jax reads their ``config.json`` and weights only. Their
semantics (docs/notes/llada2_semantics.md names the public source of each): Qwen3-style layers
with per-head q/k RMSNorm and partial rotary embeddings; the first ``first_k_dense_replace``
layers dense; then routed experts plus shared experts, sigmoid scores with a bias for choosing,
group-limited top-k, the chosen scores normalised and scaled by ``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import Any

from focus_jax.config import ConfigError, ModelConfig, MoEConfig, check_integer
from focus_jax.models.qwen3.config import require, rope_theta

MODEL_TYPES = ("llada2_moe",)
MASK_TOKEN_ID = 156895
"""LLaDA2's mask token (its config.json names none; the remote ``generate`` defaults to it)."""

GEOMETRIES: dict[str, dict[str, Any]] = {
    # LLaDA2.0-mini's sizes (16B parameters, 1.4B active).
    "llada2-mini": dict(
        vocab_size=157184, hidden_size=2048, intermediate_size=5120, num_layers=20, num_heads=16,
        num_kv_heads=4, head_dim=128, rope_theta=600_000.0, tie_word_embeddings=False,
        block_size=32, mask_token_id=MASK_TOKEN_ID, partial_rotary_factor=0.5,
        moe=dict(num_experts=256, experts_per_token=8, expert_size=512, dense_layers=(0,),
                 scores="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, num_groups=8,
                 groups_per_token=4, expert_bias=True, shared_expert_size=512)),
}

_REFUSED = {
    "use_qkv_bias": "attention biases", "use_bias": "attention biases",
    "norm_head": "a normalised LM head",
}


def from_hf(raw: dict[str, Any], dtype: str) -> ModelConfig:
    """A LLaDA2 ``config.json``."""
    require(raw, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    for field, what in _REFUSED.items():
        if raw.get(field):
            raise ConfigError(f"{field}=true is not supported (focus_jax's LLaDA2 has no {what})")
    if raw.get("use_qk_norm", True) is False:
        raise ConfigError("use_qk_norm=false is not supported (LLaDA2 norms queries and keys)")
    layers = raw["num_hidden_layers"]
    first_dense = check_integer("first_k_dense_replace", raw.get("first_k_dense_replace", 0),
                                minimum=0)
    if first_dense > layers:
        raise ConfigError(f"first_k_dense_replace ({first_dense}) exceeds num_hidden_layers "
                          f"({layers})")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    partial = raw.get("partial_rotary_factor")
    if raw.get("rotary_dim") and partial is None:
        partial = raw["rotary_dim"] / head_dim
    groups = raw.get("n_group") or 1
    shared = check_integer("num_shared_experts", raw.get("num_shared_experts") or 0, minimum=0)
    moe = MoEConfig(
        num_experts=raw["num_experts"], experts_per_token=raw["num_experts_per_tok"],
        expert_size=raw["moe_intermediate_size"], dense_layers=tuple(range(first_dense)),
        scores=raw.get("score_function", "sigmoid"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        num_groups=groups, groups_per_token=raw.get("topk_group") or groups,
        expert_bias=bool(raw.get("moe_router_enable_expert_bias", False)),
        shared_expert_size=shared * raw["moe_intermediate_size"])
    return ModelConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        block_size=raw.get("block_size"), mask_token_id=raw.get("mask_token_id"),
        model_type=raw["model_type"], dtype=dtype,
        partial_rotary_factor=float(1.0 if partial is None else partial), moe=moe)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` dictionary that :func:`from_hf` reads back."""
    m = cfg.moe
    out: dict[str, Any] = {
        "model_type": cfg.model_type, "architectures": ["LLaDA2MoeModelLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "torch_dtype": cfg.dtype,
        "num_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
        "moe_intermediate_size": m.expert_size, "first_k_dense_replace": len(m.dense_layers),
        "score_function": m.scores, "norm_topk_prob": m.norm_topk_prob,
        "routed_scaling_factor": m.routed_scaling_factor, "n_group": m.num_groups,
        "topk_group": m.groups_per_token, "moe_router_enable_expert_bias": m.expert_bias,
        "num_shared_experts": m.shared_expert_size // m.expert_size, "use_qk_norm": True,
        "use_bias": False, "use_qkv_bias": False,
    }
    if m.dense_layers != tuple(range(len(m.dense_layers))):
        raise ConfigError(f"LLaDA2 has dense layers first only, not {m.dense_layers}")
    if m.shared_expert_size % m.expert_size:
        raise ConfigError("LLaDA2's shared experts are a whole number of experts wide")
    if cfg.block_size is not None:
        out["block_size"] = cfg.block_size
    if cfg.mask_token_id is not None:
        out["mask_token_id"] = cfg.mask_token_id
    return out
