"""The Hugging Face key table of Qwen3-style layers (SDAR, Qwen3; the attention of Qwen3-MoE).

Two of our weights are several Hugging Face tensors side by side: the query, key and value
projections (``qkv_proj [E, KVH, G + 2, D]``: for each KV head its ``G`` query heads, then its
key and its value) and an MLP's gate and up projections (``gate_up_proj [E, 2, F]``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from focus_jax.config import ModelConfig
from focus_jax.models.weights import Fused, KeyTable, Weight, linear_out, same, transposed

GLOBALS = {
    "model.embed_tokens.weight": Weight(("embed",)),
    "model.norm.weight": Weight(("norm", "weight")),
    "lm_head.weight": Weight(("lm_head",), transposed, transposed),
}

QKV = Fused(2, ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            lambda c: (c.num_heads // c.num_kv_heads, 1, 1),
            lambda c, n: (c.hidden_size, c.num_kv_heads, n, c.head_dim))


def attention(stack: str = "layers") -> dict[str, Weight]:
    """A layer's norms and attention weights other than the fused Q/K/V."""
    return {
        "input_layernorm.weight": Weight((stack, "input_norm", "weight")),
        "post_attention_layernorm.weight": Weight((stack, "post_attn_norm", "weight")),
        "self_attn.o_proj.weight": Weight(
            (stack, "attn", "o_proj"),
            *linear_out(lambda c: (c.num_heads, c.head_dim, c.hidden_size))),
        "self_attn.q_norm.weight": Weight((stack, "attn", "q_norm", "weight"), same),
        "self_attn.k_norm.weight": Weight((stack, "attn", "k_norm", "weight"), same),
    }


def gate_up(prefix: str, width: Any) -> Fused:
    """An MLP's gate and up projections, ``[E, 2, F]`` with ``F = width(cfg)``."""
    return Fused(1, (f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"), lambda c: (1, 1),
                 lambda c, n: (c.hidden_size, n, width(c)))


KEY_TABLE = KeyTable(
    globals=GLOBALS,
    layer={**attention(), "mlp.down_proj.weight": Weight(("layers", "mlp", "down_proj"),
                                                         transposed, transposed)},
    fused={("layers", "attn", "qkv_proj"): QKV,
           ("layers", "mlp", "gate_up_proj"): gate_up("mlp", lambda c: c.intermediate_size)},
)


def _separate_name(part: str) -> str:
    """The name a fused weight's part had as a weight of its own (``q_proj``, ``gate_proj``)."""
    return part.split(".")[-2]


def has_separate_projections(layers: Any) -> bool:
    """``layers`` (a params tree's ``layers`` part, or its metadata) holds the fused weights'
    parts as separate weights, as folders converted before the fusion do."""
    return any(_separate_name(fused.parts[0]) in layers[path[1]]
               for path, fused in KEY_TABLE.fused.items())


def fuse_separate_projections(layers: dict, cfg: ModelConfig) -> dict:
    """``layers`` with separate stacked parts (``q_proj [L, E, H, D]``, ``k_proj``, ...,
    ``gate_proj [L, E, F]``) replaced, in place, by our fused weights."""
    for (_, module, name), fused in KEY_TABLE.fused.items():
        parts = [np.asarray(layers[module].pop(_separate_name(part))) for part in fused.parts]
        layers[module][name] = fused.join(parts, cfg, lead=1)
    return layers
