"""The Hugging Face key table of LLaDA2 checkpoints (``model.word_embeddings``, a fused
``attention.query_key_value`` of all query heads, then the keys, then the values, ``attention.dense``,
``attention.{query,key}_layernorm``, a dense ``mlp`` or a router ``mlp.gate`` with its
``expert_bias``, ``mlp.experts.X.*`` and ``mlp.shared_experts.*``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from focus_jax.config import ModelConfig
from focus_jax.models.qwen3.params import gate_up
from focus_jax.models.weights import Fused, KeyTable, Weight, concatenate, linear_out, transposed


def _qkv_to_ours(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """``[(H + 2 KVH) D, E]`` (query heads, then key heads, then value heads) ->
    ``[E, KVH, G + 2, D]`` (per KV head its ``G`` query heads, its key, its value)."""
    e, h, kvh, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    w = w.T
    q = w[:, :h * d].reshape(e, kvh, h // kvh, d)
    k = w[:, h * d:(h + kvh) * d].reshape(e, kvh, 1, d)
    v = w[:, (h + kvh) * d:].reshape(e, kvh, 1, d)
    return concatenate([q, k, v], axis=2)


def _qkv_to_hf(w, cfg: ModelConfig):
    """The inverse of :func:`_qkv_to_ours`."""
    e, g = cfg.hidden_size, cfg.num_heads // cfg.num_kv_heads
    q, k, v = w[:, :, :g].reshape(e, -1), w[:, :, g].reshape(e, -1), w[:, :, g + 1].reshape(e, -1)
    return jnp.concatenate([q, k, v], axis=1).T


KEY_TABLE = KeyTable(
    globals={
        "model.word_embeddings.weight": Weight(("embed",)),
        "model.norm.weight": Weight(("norm", "weight")),
        "lm_head.weight": Weight(("lm_head",), transposed, transposed),
    },
    layer={
        "input_layernorm.weight": Weight(("layers", "input_norm", "weight")),
        "post_attention_layernorm.weight": Weight(("layers", "post_attn_norm", "weight")),
        "attention.query_key_value.weight": Weight(("layers", "attn", "qkv_proj"), _qkv_to_ours,
                                                   _qkv_to_hf),
        "attention.dense.weight": Weight(
            ("layers", "attn", "o_proj"),
            *linear_out(lambda c: (c.num_heads, c.head_dim, c.hidden_size))),
        "attention.query_layernorm.weight": Weight(("layers", "attn", "q_norm", "weight")),
        "attention.key_layernorm.weight": Weight(("layers", "attn", "k_norm", "weight")),
        "mlp.down_proj.weight": Weight(("mlp", "down_proj"), transposed, transposed),
        "mlp.gate.weight": Weight(("moe", "router"), transposed, transposed),
        "mlp.gate.expert_bias": Weight(("moe", "expert_bias")),
        "mlp.shared_experts.down_proj.weight": Weight(("moe", "shared", "down_proj"), transposed,
                                                      transposed),
    },
    expert={"down_proj.weight": Weight(("moe", "down_proj"), transposed, transposed)},
    fused={
        ("mlp", "gate_up_proj"): gate_up("mlp", lambda c: c.intermediate_size),
        ("moe", "shared", "gate_up_proj"): gate_up("mlp.shared_experts",
                                                   lambda c: c.moe.shared_expert_size),
        ("moe", "gate_up_proj"): Fused(1, ("gate_proj.weight", "up_proj.weight"), lambda c: (1, 1),
                                       lambda c, n: (c.hidden_size, n, c.moe.expert_size),
                                       per_expert=True),
    },
)
