"""The Qwen3-style decoder that SDAR uses, as Flax NNX modules.

RMSNorm, grouped-query attention with per-head q/k RMSNorm applied before RoPE, a SwiGLU MLP and a
tied or untied LM head. Layers are stacked on a leading ``layers`` axis and scanned, so compile
time does not grow with depth. Every parameter carries logical axis names (``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ``layers``) that sharding rules map onto a mesh.

Layers expose their two halves separately: :meth:`DecoderLayer.qkv` (norm, projections, q/k-norm,
RoPE) and :meth:`DecoderLayer.finish` (attention output projection, residual, MLP). The caller
supplies the attention in between: dense block-causal attention for the uncached forward here,
attention over the KV cache in the decode step, where FOCUS evicts tokens between the two halves
of layer 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from focus_jax.config import ModelConfig


def _param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 and cast back before the scale (as Qwen3 does)."""

    def __init__(self, dim: int, eps: float, dtype: Any, axis: str):
        self.weight = _param(jnp.ones((dim,), dtype), (axis,))
        self.eps = eps

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def rope(x: Float[Array, "... n heads d"], positions: Int[Array, "... n"],
         theta: float) -> Float[Array, "... n heads d"]:
    """Rotary embedding, half-split layout (``rotate_half``), angles in float32."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[..., None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[..., None, :]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> jax.Array:
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
        self.qkv_proj = _param(_init(rngs, (e, kvh, h // kvh + 2, d), dt),
                               ("embed", "kv_heads", "qkv", "head_dim"))
        self.o_proj = _param(_init(rngs, (h, d, e), dt), ("heads", "head_dim", "embed"))
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt, "head_dim")
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt, "head_dim")
        self.rope_theta = cfg.rope_theta

    def qkv(self, x: Float[Array, "... n e"], positions: Int[Array, "... n"]):
        """Queries ``[..., n, H, D]``, keys and values ``[..., n, KVH, D]``, q/k normed and roped."""
        fused = jnp.einsum("...e,ekgd->...kgd", x, self.qkv_proj[...])
        *lead, kvh, parts, d = fused.shape
        q = fused[..., :parts - 2, :].reshape(*lead, kvh * (parts - 2), d)  # head = kv * G + g
        k, v = fused[..., parts - 2, :], fused[..., parts - 1, :]
        q = rope(self.q_norm(q), positions, self.rope_theta)
        k = rope(self.k_norm(k), positions, self.rope_theta)
        return q, k, v

    def output(self, attn: Float[Array, "... n h d"]) -> Float[Array, "... n e"]:
        return jnp.einsum("...hd,hde->...e", attn, self.o_proj[...])


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, the gate and up projections one weight
    ``[E, 2, F]`` (one GEMM)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_dtype
        self.gate_up_proj = _param(_init(rngs, (e, 2, f), dt), ("embed", "gate_up", "mlp"))
        self.down_proj = _param(_init(rngs, (f, e), dt), ("mlp", "embed"))

    def __call__(self, x: Float[Array, "... e"]) -> Float[Array, "... e"]:
        gate_up = jnp.einsum("...e,epf->...pf", x, self.gate_up_proj[...])
        return (jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]) @ self.down_proj[...]


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer, split around its attention."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = cfg.jnp_dtype
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, "embed")
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, "embed")
        self.mlp = MLP(cfg, rngs=rngs)

    def qkv(self, x: Float[Array, "... n e"], positions: Int[Array, "... n"]):
        """The first half: input norm, projections, q/k-norm, RoPE."""
        return self.attn.qkv(self.input_norm(x), positions)

    def finish(self, x: Float[Array, "... n e"],
               attn: Float[Array, "... n h d"]) -> Float[Array, "... n e"]:
        """The second half: output projection and residual, then the MLP and residual."""
        x = x + self.attn.output(attn.astype(x.dtype))
        return x + self.mlp(self.post_attn_norm(x))


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


class Decoder(nnx.Module):
    """Embedding, stacked decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = nnx.static(cfg)
        dt = cfg.jnp_dtype
        self.embed = _param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), dt), ("vocab", "embed"))

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, rngs=rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, "embed")
        self.lm_head = (None if cfg.tie_word_embeddings else
                        _param(_init(rngs, (cfg.hidden_size, cfg.vocab_size), dt),
                               ("embed", "vocab")))

    def embed_tokens(self, tokens: Int[Array, "..."]) -> Float[Array, "... e"]:
        return embedding_lookup(self.embed[...], tokens)

    def layer(self, index: int | jax.Array) -> DecoderLayer:
        """One layer of the stack (``index`` may be traced, and must then be in range), as a
        module of its own."""
        graphdef, stacked = nnx.split(self.layers)

        def take(a: jax.Array) -> jax.Array:
            # No wrap-around of negative indices: the slice's offset is the index itself (a loop
            # counter stays recognisable as one to XLA).
            return jax.lax.dynamic_index_in_dim(a, index, keepdims=False,
                                                allow_negative_indices=False)

        return nnx.merge(graphdef, jax.tree.map(take, stacked))

    def scan_layers(self, body: Callable[[DecoderLayer, Any, Any], tuple[Any, Any]], carry: Any,
                    xs: Any = None, unroll: bool = False) -> tuple[Any, Any]:
        """``lax.scan`` of ``body(layer, carry, x) -> (carry, y)`` over all layers.

        ``unroll`` lays the layers out one after another (XLA's cost analysis counts a loop body
        once; unrolled, every layer is counted), at the price of compile time growing with depth.
        """
        graphdef, stacked = nnx.split(self.layers)

        def step(carry: Any, layer_and_x: tuple[Any, Any]) -> tuple[Any, Any]:
            layer_state, x = layer_and_x
            return body(nnx.merge(graphdef, layer_state), carry, x)

        return jax.lax.scan(step, carry, (stacked, xs), unroll=unroll)

    def head(self, x: Float[Array, "... e"]) -> Float[Array, "... v"]:
        """Final norm and LM head; logits in float32."""
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.matmul(self.norm(x), w, preferred_element_type=jnp.float32)


def block_causal_mask(length: int, block_size: int) -> Array:
    """``[T, T]`` bool: query ``i`` sees key ``j`` iff ``j``'s block is not after ``i``'s."""
    blocks = jnp.arange(length) // block_size
    return blocks[None, :] <= blocks[:, None]


def dense_attention(q: Float[Array, "b t h d"], k: Float[Array, "b s kvh d"],
                    v: Float[Array, "b s kvh d"], mask: Array) -> Float[Array, "b t h d"]:
    """Softmax attention with GQA, scores and softmax in float32; ``mask`` broadcasts to [b,t,s]."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5)
    mask = jnp.broadcast_to(mask, (b, t, k.shape[1]))[:, None, None]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d)


def forward_hidden(model: Decoder, tokens: Int[Array, "b t"], positions: Int[Array, "b t"],
                   mask: Array, unroll: bool = False):
    """Uncached forward under an arbitrary attention mask (``[t, t]`` or ``[b, t, t]``, True where
    a query sees a key). Returns the last hidden states ``[b, t, e]`` and every layer's keys and
    values ``[L, b, t, KVH, D]``."""

    def body(layer: DecoderLayer, x: jax.Array, _: None):
        q, k, v = layer.qkv(x, positions)
        return layer.finish(x, dense_attention(q, k, v, mask)), (k, v)

    return model.scan_layers(body, model.embed_tokens(tokens), unroll=unroll)


def forward(model: Decoder, tokens: Int[Array, "b t"], block_size: int):
    """Uncached block-causal forward over whole sequences.

    Returns float32 logits ``[b, t, vocab]`` and every layer's keys and values
    ``[L, b, t, KVH, D]`` (what prefill writes into the cache).
    """
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x, kv = forward_hidden(model, tokens, positions, block_causal_mask(tokens.shape[1], block_size))
    return model.head(x), kv
