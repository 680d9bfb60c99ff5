"""The Hugging Face key table of Qwen3-MoE checkpoints: Qwen3's attention, then per layer either
a dense MLP (``mlp.gate_proj`` ...) or a router ``mlp.gate.weight [X, E]`` and experts
``mlp.experts.X.{gate,up,down}_proj.weight``, as the public SDAR-30B-A3B and Qwen3-30B-A3B
folders name them."""

from __future__ import annotations

from focus_jax.models.qwen3.params import GLOBALS, QKV, attention, gate_up
from focus_jax.models.weights import Fused, KeyTable, Weight, transposed

KEY_TABLE = KeyTable(
    globals=GLOBALS,
    layer={**attention(),
           "mlp.down_proj.weight": Weight(("mlp", "down_proj"), transposed, transposed),
           "mlp.gate.weight": Weight(("moe", "router"), transposed, transposed)},
    expert={"down_proj.weight": Weight(("moe", "down_proj"), transposed, transposed)},
    fused={("layers", "attn", "qkv_proj"): QKV,
           ("mlp", "gate_up_proj"): gate_up("mlp", lambda c: c.intermediate_size),
           ("moe", "gate_up_proj"): Fused(1, ("gate_proj.weight", "up_proj.weight"),
                                          lambda c: (1, 1),
                                          lambda c, n: (c.hidden_size, n, c.moe.expert_size),
                                          per_expert=True)},
)
