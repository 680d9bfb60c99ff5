"""A mixture-of-experts feed-forward: the router, the routed SwiGLU experts and a shared expert.

The router (:meth:`MoE.route`) runs in float32 and covers the two families' rules
(:class:`~focus_jax.config.MoEConfig`): softmax top-k (Qwen3-MoE, SDAR-MoE) and sigmoid scores
with an expert bias for choosing and group-limited top-k (LLaDA2). The experts run as grouped
matmuls over the rows sorted by expert (:func:`pallas_kernels.grouped_matmul.grouped_matmul`):
every (token, chosen expert) pair is computed, none dropped (a dropped token changes the answer),
and rows marked invalid (a bucket's padding) go last and outside every group, so the grouped
matmuls skip them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Bool, Float, Int
from qwix import QArray

from focus_jax.config import ModelConfig, MoEConfig
from focus_jax.models.layers import MLP, init, param
from focus_jax.models.matmul import grouped, read, weight, weight_partition
from pallas_kernels import sharding

NORM_EPS = 1e-20
"""Added to the sum of a token's chosen scores before normalising them (LLaDA2's sigmoid scores
can all be tiny; Qwen3-MoE's softmax scores never sum to zero, where it changes nothing)."""


class MoE(nnx.Module):
    """Routed experts ``gate_up_proj [X, E, 2, F]``, ``down_proj [X, F, E]``, a float32 router
    ``[E, X]`` (with an optional float32 expert bias ``[X]``) and an optional shared expert."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m = cfg.moe
        e, x, f, dt = cfg.hidden_size, m.num_experts, m.expert_size, cfg.jnp_dtype
        self.settings = nnx.static(m)
        self.router = param(init(rngs, (e, x), jnp.float32), ("embed", "router"))
        self.expert_bias = (param(init(rngs, (x,), jnp.float32), ("router",))
                            if m.expert_bias else None)
        self.gate_up_proj = weight(init(rngs, (x, e, 2, f), dt),
                                   ("expert", "embed", "gate_up", "expert_mlp"), ("embed",),
                                   cfg.quantization)
        self.down_proj = weight(init(rngs, (x, f, e), dt), ("expert", "expert_mlp", "embed"),
                                ("expert_mlp",), cfg.quantization)
        self.shared = (MLP(cfg, rngs=rngs, width=m.shared_expert_size)
                       if m.shared_expert_size else None)

    def route(self, x: Float[Array, "n e"]) -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
        """Each row's chosen experts and their weights (float32)."""
        return route(self.settings, x, self.router[...],
                     None if self.expert_bias is None else self.expert_bias[...])

    def __call__(self, x: Float[Array, "... e"], valid: Bool[Array, "n"] | None = None,
                 mesh: Mesh | None = None) -> Float[Array, "... e"]:
        """The feed-forward of normed hidden states; rows where ``valid`` is False (``x``
        then ``[n, e]``) come out as zeros plus the shared expert's output. On ``mesh`` the
        experts split over its ``expert`` axis and their width over ``model``
        (:func:`run_experts_sharded`)."""
        lead, e = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, e)
        experts, weights = self.route(rows)
        routed = run_experts_sharded(mesh, rows, experts, weights, read(self.gate_up_proj),
                                     read(self.down_proj), valid)
        if self.shared is not None:
            routed = routed + self.shared(rows)
        return routed.reshape(*lead, e)


def route(m: MoEConfig, x: Float[Array, "n e"], router: Float[Array, "e x"],
          bias: Float[Array, "x"] | None) -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
    """The routing rule of ``m`` for rows ``x``: expert ids ``[n, k]`` and weights ``[n, k]``.

    Scores are ``softmax`` or ``sigmoid`` of the float32 logits. The choice ranks scores plus
    ``bias`` (the weights use the scores without it); with groups, only the experts of the
    ``groups_per_token`` groups with the highest sum of their two best (biased) scores compete.
    The chosen scores are normalised to sum 1 (``norm_topk_prob``), then scaled by
    ``routed_scaling_factor``. Ties go to the lower expert id.
    """
    logits = jnp.matmul(x.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.softmax(logits, axis=-1) if m.scores == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if m.num_groups > 1:
        n = x.shape[0]
        grouped = choice.reshape(n, m.num_groups, -1)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [n, groups]
        _, kept = jax.lax.top_k(group_score, m.groups_per_token)
        keep = jax.nn.one_hot(kept, m.num_groups, dtype=jnp.int32).sum(axis=1) > 0
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, -1)
    _, experts = jax.lax.top_k(choice, m.experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if m.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + NORM_EPS)
    return experts, weights * m.routed_scaling_factor


def run_experts(x: Float[Array, "n e"], experts: Int[Array, "n k"], weights: Float[Array, "n k"],
                gate_up: Float[Array, "x e 2 f"] | QArray, down: Float[Array, "x f e"] | QArray,
                valid: Bool[Array, "n"] | None = None, *, pairs: Bool[Array, "n k"] | None = None,
                out_dtype: jnp.dtype | None = None) -> Float[Array, "n e"]:
    """``sum_j weights[i, j] * expert_{experts[i, j]}(x[i])`` for every row: the ``n * k``
    (row, expert) pairs sorted by expert, two grouped matmuls, then each row's pairs summed in
    float32 (returned as ``out_dtype``, default ``x``'s). Pairs of invalid rows (and those
    ``pairs`` leaves out) sort last, outside every group: no expert computes them, and they add
    nothing."""
    n, k = experts.shape
    num_experts, e, _, f = gate_up.shape
    keep = pairs if valid is None else valid[:, None] if pairs is None else valid[:, None] & pairs
    pair_expert = experts.reshape(n * k)
    if keep is not None:
        keep = jnp.broadcast_to(keep, (n, k))
        pair_expert = jnp.where(keep.reshape(n * k), pair_expert, num_experts)
        weights = jnp.where(keep, weights, 0.0)
    order = jnp.argsort(pair_expert, stable=True)
    sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[pair_expert].add(1)[:num_experts]
    h = grouped(x[order // k], gate_up.reshape(num_experts, e, 2 * f), sizes)
    h = (jax.nn.silu(h[:, :f]) * h[:, f:]).astype(x.dtype)
    y = grouped(h, down, sizes, preferred_element_type=jnp.float32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    y = y[inverse].reshape(n, k, e)
    if keep is not None:
        y = jnp.where(keep[..., None], y, 0.0)  # left-out pairs: whatever the kernel left
    return (y * weights[..., None]).sum(axis=1).astype(out_dtype or x.dtype)


def run_experts_sharded(mesh: Mesh | None, x: Float[Array, "n e"], experts: Int[Array, "n k"],
                        weights: Float[Array, "n k"],
                        gate_up: Float[Array, "x e 2 f"] | QArray,
                        down: Float[Array, "x f e"] | QArray,
                        valid: Bool[Array, "n"] | None = None) -> Float[Array, "n e"]:
    """:func:`run_experts` with the experts split over ``mesh``'s ``expert`` axis and their
    width over ``model`` (where those axes are larger than one; else the function itself).
    Every device holds all rows (the token exchange is a sum: each device computes its own
    experts' pairs, at its share of the width, and the partial outputs are summed over both
    axes), so no token waits for another device's capacity and none is dropped. Where the
    ``expert`` axis is already manual (the step of a mesh with ``data`` and ``expert`` axes,
    :func:`focus_jax.decoding.step`), ``gate_up`` and ``down`` are this device's experts."""
    experts_axis = sharding.split(mesh, sharding.EXPERTS)
    held_axis = sharding.held(mesh, sharding.EXPERTS)
    width_axis = sharding.split(mesh, sharding.HEADS)
    if experts_axis is None and held_axis is None and width_axis is None:
        return run_experts(x, experts, weights, gate_up, down, valid)
    sharding.check_divides(gate_up.shape[0], mesh, sharding.EXPERTS, "num_experts")
    sharding.check_divides(gate_up.shape[-1], mesh, sharding.HEADS, "moe_intermediate_size")
    summed = tuple(a for a in (experts_axis, held_axis, width_axis) if a is not None)

    def local(x, experts, weights, gate_up, down, valid):
        count = gate_up.shape[0]
        split_over = experts_axis or held_axis
        first = 0 if split_over is None else jax.lax.axis_index(split_over) * count
        mine = (experts >= first) & (experts < first + count)
        out = run_experts(x, jnp.where(mine, experts - first, 0), weights, gate_up, down, valid,
                          pairs=mine, out_dtype=jnp.float32)
        return jax.lax.psum(out, summed)

    P = PartitionSpec
    valid = jnp.ones(x.shape[:1], bool) if valid is None else valid
    if experts_axis is None and width_axis is None:  # the experts held, nothing left to split
        return local(x, experts, weights, gate_up, down, valid).astype(x.dtype)
    run = sharding.manual(local, mesh, (P(), P(), P(),
                                        weight_partition(gate_up, P(experts_axis, None, None,
                                                                    width_axis)),
                                        weight_partition(down, P(experts_axis, width_axis, None)),
                                        P()), P())
    return run(x, experts, weights, gate_up, down, valid).astype(x.dtype)
