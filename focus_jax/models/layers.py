"""The building blocks every decoder family shares, as Flax NNX modules.

RMSNorm, rotary embeddings (whole or partial), grouped-query attention projections with per-head
q/k RMSNorm before RoPE, a SwiGLU MLP and the embedding lookup. Every parameter carries logical
axis names (``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ...) that
sharding rules map onto a mesh (:mod:`focus_jax.sharding`). How a family stacks them into a
decoder: :mod:`focus_jax.models.decoder`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from focus_jax.config import ModelConfig
from focus_jax.models.matmul import param, project, weight


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 and cast back before the scale (as Qwen3 does)."""

    def __init__(self, dim: int, eps: float, dtype: Any, axis: str):
        self.weight = param(jnp.ones((dim,), dtype), (axis,))
        self.eps = eps

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def rope(x: Float[Array, "... n heads d"], positions: Int[Array, "... n"],
         theta: float, rotary_dim: int | None = None) -> Float[Array, "... n heads d"]:
    """Rotary embedding, half-split layout (``rotate_half``), angles in float32, on the first
    ``rotary_dim`` features of each head (all by default; partial rotary leaves the rest as
    they are)."""
    dim = x.shape[-1] if rotary_dim is None else rotary_dim
    if dim < x.shape[-1]:
        return jnp.concatenate([rope(x[..., :dim], positions, theta), x[..., dim:]], axis=-1)
    half = dim // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[..., None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[..., None, :]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Attention(nnx.Module):
    """Grouped-query attention projections with per-head q/k RMSNorm before RoPE.

    The query, key and value projections are one weight ``[E, KVH, G + 2, D]``: for each KV
    head, its ``G`` query heads, its key and its value. One GEMM instead of three (two of them
    small: a lightly loaded decode step is bound by launches and latency), and sharded over KV
    heads every device holds whole groups."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, h, kvh, d, dt = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            cfg.jnp_dtype)
        q = cfg.quantization
        self.qkv_proj = weight(init(rngs, (e, kvh, h // kvh + 2, d), dt),
                               ("embed", "kv_heads", "qkv", "head_dim"), ("embed",), q)
        self.o_proj = weight(init(rngs, (h, d, e), dt), ("heads", "head_dim", "embed"),
                             ("heads", "head_dim"), q)
        self.quantization = nnx.static(q)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt, "head_dim")
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt, "head_dim")
        self.rope_theta = cfg.rope_theta
        self.rotary_dim = cfg.rotary_dim

    def qkv(self, x: Float[Array, "... n e"], positions: Int[Array, "... n"]):
        """Queries ``[..., n, H, D]``, keys and values ``[..., n, KVH, D]``, q/k normed and roped."""
        fused = project("...e,ekgd->...kgd", x, self.qkv_proj, self.quantization)
        *lead, kvh, parts, d = fused.shape
        q = fused[..., :parts - 2, :].reshape(*lead, kvh * (parts - 2), d)  # head = kv * G + g
        k, v = fused[..., parts - 2, :], fused[..., parts - 1, :]
        q = rope(self.q_norm(q), positions, self.rope_theta, self.rotary_dim)
        k = rope(self.k_norm(k), positions, self.rope_theta, self.rotary_dim)
        return q, k, v

    def output(self, attn: Float[Array, "... n h d"]) -> Float[Array, "... n e"]:
        return project("...hd,hde->...e", attn, self.o_proj, self.quantization)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, the gate and up projections one weight
    ``[E, 2, F]`` (one GEMM). ``width``: ``F`` (default: the config's ``intermediate_size``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, width: int | None = None):
        e, f, dt = cfg.hidden_size, width or cfg.intermediate_size, cfg.jnp_dtype
        q = cfg.quantization
        self.gate_up_proj = weight(init(rngs, (e, 2, f), dt), ("embed", "gate_up", "mlp"),
                                   ("embed",), q)
        self.down_proj = weight(init(rngs, (f, e), dt), ("mlp", "embed"), ("mlp",), q)
        self.quantization = nnx.static(q)

    def __call__(self, x: Float[Array, "... e"]) -> Float[Array, "... e"]:
        gate_up = project("...e,epf->...pf", x, self.gate_up_proj, self.quantization)
        hidden = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        return project("...f,fe->...e", hidden, self.down_proj, self.quantization)


@jax.custom_vjp
def embedding_lookup(table: Float[Array, "v e"], tokens: Int[Array, "..."]) -> Float[Array, "... e"]:
    """``table[tokens]``, with the table's gradient summed in float32.

    That gradient adds one row per token into the table. In bfloat16 that scatter-add took 97 ms
    of a 131 ms training step on an H200 (a 384-token vocabulary, so about 85 tokens per row;
    docs/training.md); in float32 it is cheap, and small terms are not lost to a large running
    sum.

    Token ids are clipped into the table (callers check them against the vocabulary): ``take``'s
    default fills out-of-range rows instead, a select over the whole output (44 us of a lightly
    loaded decode step on an H200, which embeds every row of its flat token axis).
    """
    return jnp.take(table, tokens, axis=0, mode="clip")


def _lookup_forward(table: Array, tokens: Array) -> tuple[Array, tuple[Array, Array]]:
    return jnp.take(table, tokens, axis=0, mode="clip"), (table, tokens)


def _lookup_backward(saved: tuple[Array, Array], grad: Array) -> tuple[Array, None]:
    table, tokens = saved
    summed = jnp.zeros(table.shape, jnp.float32).at[tokens].add(grad.astype(jnp.float32))
    return summed.astype(table.dtype), None


embedding_lookup.defvjp(_lookup_forward, _lookup_backward)


