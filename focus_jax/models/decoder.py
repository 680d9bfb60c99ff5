"""The decoder every family builds, and the protocol the decoding step uses it through.

A decoder is an embedding, ``L`` stacked pre-norm layers, a final norm and an LM head. Layers are
stacked on a leading ``layers`` axis and scanned, so compile time does not grow with depth. A
layer's feed-forward is of one of two kinds (:attr:`ModelConfig.layer_kinds`): ``dense`` (a
SwiGLU MLP) or ``sparse`` (a mixture of experts, :mod:`focus_jax.models.moe`). Where every layer
is dense, the MLP sits in the layer stack (``layers.mlp``); otherwise each kind is stacked on its
own (``mlp`` over the dense layers, ``moe`` over the sparse ones) beside the attention stack,
and a run of layers is scanned one run of equal kinds at a time (:attr:`Decoder.runs`), never
unrolled.

**The protocol** (what :mod:`focus_jax.decoding` asks of a model, and all it asks):

- :meth:`Decoder.embed_tokens`, :meth:`Decoder.head`;
- :meth:`Decoder.layer` (a static index) and :meth:`Decoder.fori_layers` (a loop over a range
  of layers), which hand out :class:`Layer` views with two halves: :meth:`Layer.qkv` (norm,
  projections, q/k-norm, RoPE) and :meth:`Layer.finish` (output projection, feed-forward). The
  caller supplies the attention between them: dense block-causal attention for the uncached
  forward here, attention over the KV cache in the decode step, where FOCUS evicts tokens
  between the two halves of layer 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from focus_jax.config import ModelConfig
from focus_jax.models.layers import MLP, Attention, RMSNorm, embedding_lookup, init, param
from focus_jax.models.matmul import project
from focus_jax.models.moe import MoE


class DecoderLayer(nnx.Module):
    """One pre-norm layer's attention and norms, and its MLP when every layer is dense."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = cfg.jnp_dtype
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, "embed")
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, "embed")
        self.mlp = MLP(cfg, rngs=rngs) if cfg.moe is None else None


FeedForward = Callable[[Array, Array | None, Mesh | None], Array]


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer as the step sees it, split around its attention."""

    block: DecoderLayer
    feed_forward: FeedForward
    """``(x, valid, mesh) -> y``: the layer's MLP or experts on normed hidden states."""

    def qkv(self, x: Float[Array, "... n e"], positions: Int[Array, "... n"]):
        """The first half: input norm, projections, q/k-norm, RoPE. Queries ``[..., n, H, D]``,
        keys and values ``[..., n, KVH, D]``."""
        return self.block.attn.qkv(self.block.input_norm(x), positions)

    def finish(self, x: Float[Array, "... n e"], attn: Float[Array, "... n h d"],
               valid: Bool[Array, "n"] | None = None,
               mesh: Mesh | None = None) -> Float[Array, "... n e"]:
        """The second half: output projection and residual, then the feed-forward and residual.
        ``valid``: the rows that matter (padding rows of a bucket are False; experts skip them).
        ``mesh``: the mesh the caller runs on (experts split over its ``expert`` axis)."""
        x = x + self.block.attn.output(attn.astype(x.dtype))
        return x + self.feed_forward(self.block.post_attn_norm(x), valid, mesh)


@dataclasses.dataclass(frozen=True)
class Run:
    """Layers ``[start, stop)``, all of feed-forward ``kind``; the first is its kind stack's
    entry ``offset``."""

    start: int
    stop: int
    kind: str
    offset: int


def layer_runs(kinds: tuple[str, ...]) -> tuple[Run, ...]:
    """The maximal runs of consecutive layers of equal kind."""
    runs: list[Run] = []
    seen = {"dense": 0, "sparse": 0}
    for index, kind in enumerate(kinds):
        if runs and runs[-1].kind == kind:
            runs[-1] = dataclasses.replace(runs[-1], stop=index + 1)
        else:
            runs.append(Run(index, index + 1, kind, seen[kind]))
        seen[kind] += 1
    return tuple(runs)


def _stacked(count: int, make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """``count`` modules stacked on a leading ``layers`` axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return build(rngs)


def _take(stack: nnx.Module, index: int | jax.Array) -> nnx.Module:
    """Entry ``index`` (may be traced, and must then be in range) of a stacked module."""
    graphdef, stacked = nnx.split(stack)

    def take(a: jax.Array) -> jax.Array:
        # No wrap-around of negative indices: the slice's offset is the index itself (a loop
        # counter stays recognisable as one to XLA).
        return jax.lax.dynamic_index_in_dim(a, index, keepdims=False, allow_negative_indices=False)

    return nnx.merge(graphdef, jax.tree.map(take, stacked))


def _slice(stack: nnx.Module, start: int, stop: int) -> nnx.State:
    """Entries ``[start, stop)`` of a stacked module's state."""
    _, stacked = nnx.split(stack)
    return jax.tree.map(lambda a: a if (start, stop) == (0, a.shape[0]) else a[start:stop], stacked)


class Decoder(nnx.Module):
    """Embedding, stacked decoder layers (feed-forwards stacked per kind), final norm, LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = nnx.static(cfg)
        dt = cfg.jnp_dtype
        self.embed = param(init(rngs, (cfg.vocab_size, cfg.hidden_size), dt), ("vocab", "embed"))
        self.layers = _stacked(cfg.num_layers, lambda r: DecoderLayer(cfg, rngs=r), rngs)
        kinds = cfg.layer_kinds
        dense, sparse = kinds.count("dense"), kinds.count("sparse")
        self.mlp = (_stacked(dense, lambda r: MLP(cfg, rngs=r), rngs)
                    if cfg.moe is not None and dense else None)
        self.moe = _stacked(sparse, lambda r: MoE(cfg, rngs=r), rngs) if sparse else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, "embed")
        self.lm_head = (None if cfg.tie_word_embeddings else
                        param(init(rngs, (cfg.hidden_size, cfg.vocab_size), dt),
                              ("embed", "vocab")))

    @property
    def runs(self) -> tuple[Run, ...]:
        """The layers in runs of equal feed-forward kind (one run when every layer is alike)."""
        return layer_runs(self.config.layer_kinds)

    def embed_tokens(self, tokens: Int[Array, "..."]) -> Float[Array, "... e"]:
        return embedding_lookup(self.embed[...], tokens)

    def _feed_forward(self, block: DecoderLayer, kind: str,
                      ffn: nnx.Module | None) -> FeedForward:
        if kind == "sparse":
            return ffn
        mlp = block.mlp if ffn is None else ffn
        return lambda x, valid, mesh: mlp(x)

    def _layer(self, index: int | jax.Array, run: Run) -> Layer:
        """Layer ``index`` of ``run`` (``index`` may be traced within the run)."""
        block = _take(self.layers, index)
        stack = self.moe if run.kind == "sparse" else self.mlp
        # The kind's own index is the layer index itself where they coincide (a dense model's
        # one run), so that its weights stay sliced by the loop counter alone.
        entry = index if run.start == run.offset else index - run.start + run.offset
        ffn = None if stack is None else _take(stack, entry)
        return Layer(block, self._feed_forward(block, run.kind, ffn))

    def _run_of(self, index: int) -> Run:
        return next(run for run in self.runs if run.start <= index < run.stop)

    def layer(self, index: int) -> Layer:
        """Layer ``index`` (a Python int) as a :class:`Layer`."""
        return self._layer(index, self._run_of(index))

    def fori_layers(self, start: int, stop: int,
                    body: Callable[[jax.Array, Layer, Any], Any], carry: Any,
                    unroll: bool = False) -> Any:
        """``body(index, layer, carry) -> carry`` over layers ``[start, stop)``: a
        ``fori_loop`` per run of equal kind, its counter the layer index (XLA's GPU dynamic-slice
        fusion lets each matmul read its layer's weights in place in the stack only for offsets
        computed from a loop counter; docs/benchmarks.md, "Weight reads")."""
        for run in self.runs:
            lo, hi = max(start, run.start), min(stop, run.stop)
            if lo < hi:
                carry = jax.lax.fori_loop(
                    lo, hi, lambda i, c, run=run: body(i, self._layer(i, run), c), carry,
                    unroll=unroll)
        return carry

    def scan_layers(self, body: Callable[[Layer, Any, Any], tuple[Any, Any]], carry: Any,
                    xs: Any = None, unroll: bool = False) -> tuple[Any, Any]:
        """``lax.scan`` of ``body(layer, carry, x) -> (carry, y)`` over all layers (one scan per
        run of equal kind; ``xs`` and the ``ys`` returned have a leading layer axis).

        ``unroll`` lays the layers out one after another (XLA's cost analysis counts a loop body
        once; unrolled, every layer is counted), at the price of compile time growing with depth.
        """
        block_def, _ = nnx.split(self.layers)
        outputs = []
        for run in self.runs:
            stack = self.moe if run.kind == "sparse" else self.mlp
            count = run.stop - run.start
            ffn_def, ffn = (None, None) if stack is None else (
                nnx.graphdef(stack), _slice(stack, run.offset, run.offset + count))
            run_xs = jax.tree.map(lambda a, run=run: a[run.start:run.stop], xs)

            def step(carry: Any, per_layer: tuple[Any, Any, Any], run=run, ffn_def=ffn_def):
                block_state, ffn_state, x = per_layer
                block = nnx.merge(block_def, block_state)
                module = None if ffn_def is None else nnx.merge(ffn_def, ffn_state)
                return body(Layer(block, self._feed_forward(block, run.kind, module)), carry, x)

            carry, ys = jax.lax.scan(step, carry,
                                     (_slice(self.layers, run.start, run.stop), ffn, run_xs),
                                     unroll=unroll)
            outputs.append(ys)
        if len(outputs) == 1:
            return carry, outputs[0]
        return carry, jax.tree.map(lambda *ys: jnp.concatenate(ys), *outputs)

    def head(self, x: Float[Array, "... e"]) -> Float[Array, "... v"]:
        """Final norm and LM head; logits in float32."""
        if self.lm_head is None:
            return project("...e,ve->...v", self.norm(x), self.embed,
                           preferred_element_type=jnp.float32)
        return project("...e,ev->...v", self.norm(x), self.lm_head,
                       preferred_element_type=jnp.float32)


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
                   mask: Array, unroll: bool = False, mesh: Mesh | None = None):
    """Uncached forward under an arbitrary attention mask (``[t, t]`` or ``[b, t, t]``, True where
    a query sees a key). Returns the last hidden states ``[b, t, e]`` and every layer's keys and
    values ``[L, b, t, KVH, D]``. ``mesh``: the mesh the parameters live on."""

    def body(layer: Layer, x: jax.Array, _: None):
        q, k, v = layer.qkv(x, positions)
        return layer.finish(x, dense_attention(q, k, v, mask), mesh=mesh), (k, v)

    return model.scan_layers(body, model.embed_tokens(tokens), unroll=unroll)


def forward_after_prefix(model: Decoder, tokens: Int[Array, "b t"], positions: Int[Array, "b t"],
                         prefix_k: Float[Array, "layers b p kvh d"],
                         prefix_v: Float[Array, "layers b p kvh d"],
                         prefix_visible: Bool[Array, "b p"], block_size: int,
                         mesh: Mesh | None = None):
    """Block-causal forward of ``tokens`` that continue a sequence whose earlier keys and values
    are given (a cached prompt prefix): each row's tokens start at a block boundary
    (``positions``), see each other block-causally and see the prefix positions
    ``prefix_visible``. Returns the last hidden states ``[b, t, e]`` and every layer's keys and
    values of ``tokens`` ``[L, b, t, KVH, D]``."""
    b, t = tokens.shape
    mask = jnp.concatenate([jnp.broadcast_to(prefix_visible[:, None, :], (b, t, prefix_k.shape[2])),
                            jnp.broadcast_to(block_causal_mask(t, block_size), (b, t, t))], axis=-1)

    def body(layer: Layer, x: jax.Array, prefix: tuple[jax.Array, jax.Array]):
        q, k, v = layer.qkv(x, positions)
        keys = jnp.concatenate([prefix[0].astype(k.dtype), k], axis=1)
        values = jnp.concatenate([prefix[1].astype(v.dtype), v], axis=1)
        return layer.finish(x, dense_attention(q, keys, values, mask), mesh=mesh), (k, v)

    return model.scan_layers(body, model.embed_tokens(tokens), xs=(prefix_k, prefix_v))


def router_choices(model: Decoder, tokens: Int[Array, "b t"],
                   block_size: int) -> Int[Array, "layers b t k"]:
    """Every layer's chosen experts in the uncached block-causal forward, ascending per token
    (-1 in dense layers): what a mixture's router decides for each token, for tests and
    analysis."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    mask = block_causal_mask(tokens.shape[1], block_size)
    k = model.config.moe.experts_per_token

    def body(layer: Layer, x: jax.Array, _: None):
        q, keys, values = layer.qkv(x, positions)
        attn = dense_attention(q, keys, values, mask)
        rows = x.shape[0] * x.shape[1]
        if isinstance(layer.feed_forward, MoE):
            normed = layer.block.post_attn_norm(x + layer.block.attn.output(attn.astype(x.dtype)))
            experts = jnp.sort(layer.feed_forward.route(normed.reshape(rows, -1))[0], axis=-1)
        else:
            experts = jnp.full((rows, k), -1, jnp.int32)
        return layer.finish(x, attn), experts.reshape(*x.shape[:2], k)

    return model.scan_layers(body, model.embed_tokens(tokens))[1]


def forward(model: Decoder, tokens: Int[Array, "b t"], block_size: int,
            mesh: Mesh | None = None):
    """Uncached block-causal forward over whole sequences (``mesh``: the parameters' mesh).

    Returns float32 logits ``[b, t, vocab]`` and every layer's keys and values
    ``[L, b, t, KVH, D]`` (what prefill writes into the cache).
    """
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x, kv = forward_hidden(model, tokens, positions, block_causal_mask(tokens.shape[1], block_size),
                           mesh=mesh)
    return model.head(x), kv
