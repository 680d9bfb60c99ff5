"""Block-diffusion decoding on the device: the decode state, prefill and the denoising step.

Everything here is a pure function of pytrees, compiled once per shape. The step
(SPEC_FOCUS sections 3-6) runs every slot's active block in one call:

1. **processed** tokens (the whole block in ``baseline``; the not-yet-cached slots with the
   delayed KV cache, or the whole block at a commit step with ``commit_refresh``) are
   compacted into the smallest bucket that holds them and run through layer 0 and the first
   half of layer 1 (their KV written in both);
2. in ``focus`` mode, the change of masked-token importance between layers 0 and 1 selects the
   **retained** tokens; otherwise every processed token is retained;
3. retained tokens are compacted again and run through the rest of layer 1, layers ``>= 2`` and
   the LM head; the unmasking rule decodes some of their masked slots;
4. slot states, the delayed-cache flags, block statistics, stops and commits are updated.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from focus_jax import interrupts, sharding
from focus_jax.cache import ContiguousCache, KVCache, PagedCache, assign_pages
from focus_jax.compaction import Compaction
from focus_jax.config import ModelConfig
from focus_jax.models.decoder import Decoder, Layer, forward, forward_after_prefix
from focus_jax.policies import CACHED, MASKED, UNMASKED, Eviction, Policies, RowSampling
from pallas_kernels.ragged_attention.reference import SlotLayout, slot_layout

__all__ = ["CACHED", "MASKED", "UNMASKED", "DecodeSettings", "DecodeState", "RoundResults",
           "SlotParams", "StepLog", "decode_round", "decoded_per_step", "init_state",
           "pack_round", "packed_width", "prefill", "release", "set_pages", "step", "unpack_round",
           "window_width"]

MAX_STOP_IDS = 8
"""Stop token ids a request may name (the per-slot table's width)."""


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Everything static about a decode program (hashable: a jit static argument). What a
    request may choose for itself lives in the state (:class:`SlotParams`)."""

    block_size: int
    mask_token_id: int
    policies: Policies
    """Processed-token policy, eviction policy, unmasking rule and sampler."""
    processed_ladder: tuple[int, ...]
    """Bucket sizes for the processed tokens (rows of the flat ``S*B`` token axis)."""
    retained_ladder: tuple[int, ...]
    """Bucket sizes for the retained tokens."""
    kernels: str | None = None
    """Kernel implementation for attention (``None``: the platform default)."""
    unroll_layers: bool = False
    """Unroll the layer scan (for cost analysis; compile time then grows with depth)."""
    mesh: Mesh | None = None
    """The mesh the state lives on. Where its ``data`` axis splits the slots, each data shard
    runs the step on its own slots (its own compaction and buckets; the ladders count one
    shard's rows)."""
    interruptible: bool = False
    """The round asks the host after every step whether to end (:mod:`focus_jax.interrupts`)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotParams:
    """Each slot's request parameters (``S`` rows; the rows of a prefill batch have ``n``)."""

    max_new: Int[Array, "s"]
    temperature: Float[Array, "s"]
    """0: greedy."""
    top_k: Int[Array, "s"]
    """0: no limit."""
    top_p: Float[Array, "s"]
    threshold: Float[Array, "s"]
    """Confidence threshold of the unmasking rule."""
    alpha: Float[Array, "s"]
    """FOCUS budget factor."""
    stop_ids: Int[Array, "s k"]
    """Stop token ids, padded with -1 (which no token equals)."""
    seed: Int[Array, "s"]
    commit_refresh: Bool[Array, "s"]
    """Run the whole block once more, with its final tokens, at its commit step (delayed KV
    cache; ``policies.DelayedCache``)."""

    @classmethod
    def empty(cls, slots: int) -> SlotParams:
        def zeros(dtype=jnp.int32) -> Array:  # a buffer per field (the state is donated)
            return jnp.zeros((slots,), dtype)

        return cls(max_new=zeros(), temperature=zeros(jnp.float32), top_k=zeros(),
                   top_p=zeros(jnp.float32) + 1, threshold=zeros(jnp.float32) + 1,
                   alpha=zeros(jnp.float32) + 1, stop_ids=jnp.full((slots, MAX_STOP_IDS), -1),
                   seed=zeros(jnp.uint32), commit_refresh=zeros(bool))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode state of ``S`` slots with block size ``B`` and ``M`` cache positions per slot."""

    tokens: Int[Array, "s b"]
    """The active block's tokens (the mask token where still masked)."""
    slot_state: Int[Array, "s b"]
    """MASKED, UNMASKED or CACHED per position of the active block."""
    history: Int[Array, "s"]
    """Leading positions whose KV is final (a multiple of B); the active block starts there."""
    progress: Int[Array, "s"]
    """Rightmost slot of the block with KV in every layer (-1 at block start)."""
    block_decoded: Int[Array, "s"]
    """Tokens unmasked so far in the active block."""
    block_steps: Int[Array, "s"]
    """Steps of the active block that unmasked at least one token."""
    live: Bool[Array, "s"]
    """The slot holds a request that is still decoding."""
    prompt_len: Int[Array, "s"]
    out_len: Int[Array, "s"]
    """Generated tokens to return, set when the request finishes."""
    sequence: Int[Array, "s m"]
    """Prompt and completed blocks of each slot."""
    params: SlotParams
    cache: KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepLog:
    """What one step did to each position of each slot's active block, and its buckets."""

    processed: Bool[Array, "s b"]
    """Ran through layers 0-1."""
    retained: Bool[Array, "s b"]
    """Ran through every layer."""
    decoded: Bool[Array, "s b"]
    """Unmasked by this step."""
    sampled: Bool[Array, "s b"]
    """Ran through the LM head (masked and retained, in a slot still decoding)."""
    live: Bool[Array, "s"]
    """The slot took part (a denoising or a commit step)."""
    processed_bucket: Int[Array, ""]
    """Rows of the processed tokens' bucket."""
    retained_bucket: Int[Array, ""]
    """Rows of the retained tokens' bucket."""


def init_state(cfg: ModelConfig, slots: int, positions: int, block_size: int,
               mask_token_id: int, pages: int | None = None) -> DecodeState:
    """An engine state with every slot free. ``pages``: a paged KV cache of that many pages of
    one block (:class:`~focus_jax.cache.PagedCache`, no slot holding any yet); ``None``: the
    contiguous cache, ``positions`` per slot."""
    if positions % block_size:
        raise ValueError(f"cache positions {positions} must be a multiple of the block size")
    def zeros() -> Array:  # a buffer per field: the state is donated, and buffers must not alias
        return jnp.zeros((slots,), jnp.int32)

    return DecodeState(
        tokens=jnp.full((slots, block_size), mask_token_id, jnp.int32),
        slot_state=jnp.zeros((slots, block_size), jnp.int32),
        history=zeros(), progress=zeros() - 1, block_decoded=zeros(), block_steps=zeros(),
        live=jnp.zeros((slots,), bool), prompt_len=zeros(), out_len=zeros(),
        sequence=jnp.full((slots, positions), mask_token_id, jnp.int32),
        params=SlotParams.empty(slots),
        cache=(ContiguousCache.create(cfg, slots, positions) if pages is None
               else PagedCache.create(cfg, slots, positions, block_size, pages)),
    )


def prefill(model: Decoder, state: DecodeState, tokens: Int[Array, "n t"],
            length: Int[Array, "n"], slot: Int[Array, "n"], params: SlotParams,
            block_size: int, mask_token_id: int, mesh: Mesh | None = None,
            start: Int[Array, "n"] | None = None, computed: int | None = None) -> DecodeState:
    """Start requests in slots (SPEC 2): write the KV of every full prompt block.

    ``tokens`` are prompts right-padded to a common length (a multiple of B); rows whose ``slot``
    is out of range are padding and change nothing. The block holding the prompt tail (or a
    fresh block when the prompt fills its blocks) becomes the active block, its prompt positions
    ``UNMASKED``. ``params`` are the requests' parameters (``n`` rows); ``mesh``: the mesh
    the parameters and state live on.

    ``start``: each row's leading prompt positions whose KV its slot's cache already holds (whole
    blocks: a cached prefix, :mod:`focus_jax.cache.pages`); only ``computed`` (static) positions
    from there are run, attending to the cached ones (the first ``t - computed`` positions of the
    slot are read), and positions from ``start`` on are written.
    """
    b, mask = block_size, mask_token_id
    n, t = tokens.shape
    history = (length // b) * b
    if start is None:
        start = jnp.zeros_like(length)
        _, (k, v) = forward(model, tokens, b, mesh)
    else:
        position = start[:, None] + jnp.arange(computed)
        window = jnp.take_along_axis(tokens, jnp.clip(position, 0, t - 1), axis=1)
        prefix = t - computed
        prefix_k, prefix_v = state.cache.read_prefix(slot, prefix)
        _, (k, v) = forward_after_prefix(model, window, position, prefix_k, prefix_v,
                                         jnp.arange(prefix)[None, :] < start[:, None], b, mesh)
    cache = state.cache.write_prefix(slot, start, history, k, v)

    position = history[:, None] + jnp.arange(b)
    in_prompt = position < length[:, None]
    tail = jnp.take_along_axis(tokens, jnp.clip(position, 0, t - 1), axis=1)
    block = jnp.where(in_prompt, tail, mask)
    m = state.sequence.shape[1]
    row = jnp.full((n, m), mask, jnp.int32)
    row = row.at[:, :t].set(jnp.where(jnp.arange(t) < length[:, None], tokens, mask)[:, :m])

    def put(field: Array, value: Array) -> Array:
        return field.at[slot].set(value.astype(field.dtype), mode="drop")

    return dataclasses.replace(
        state,
        tokens=put(state.tokens, block),
        slot_state=put(state.slot_state, jnp.where(in_prompt, UNMASKED, MASKED)),
        history=put(state.history, history),
        progress=put(state.progress, jnp.full((n,), -1)),
        block_decoded=put(state.block_decoded, jnp.zeros((n,))),
        block_steps=put(state.block_steps, jnp.zeros((n,))),
        live=put(state.live, jnp.ones((n,), bool)),
        prompt_len=put(state.prompt_len, length),
        out_len=put(state.out_len, jnp.zeros((n,))),
        sequence=put(state.sequence, row),
        params=jax.tree.map(put, state.params, params),
        cache=cache,
    )


def release(state: DecodeState, slots: Int[Array, "n"]) -> DecodeState:
    """Stop the requests in ``slots`` (aborted): they take no further steps. Out-of-range
    entries are padding."""
    return dataclasses.replace(state, live=state.live.at[slots].set(False, mode="drop"))


def set_pages(state: DecodeState, slots: Int[Array, "n"], table: Int[Array, "n w"]) -> DecodeState:
    """Give the slots ``slots`` the page-table rows ``table`` (a paged cache; out-of-range
    entries of ``slots`` are padding)."""
    return dataclasses.replace(state, cache=assign_pages(state.cache, slots, table))


def _rightmost(flags: Bool[Array, "s b"]) -> Int[Array, "s"]:
    return jnp.max(jnp.where(flags, jnp.arange(flags.shape[-1]), -1), axis=-1)


def step(model: Decoder, state: DecodeState,
         settings: DecodeSettings) -> tuple[DecodeState, StepLog]:
    """One denoising (or commit) step for every live slot.

    With a ``data`` axis in ``settings.mesh``, every data shard steps its own slots
    (``shard_map`` over ``data``; the ``model`` axis stays with the partitioner): compaction,
    buckets and row gathers stay on the shard's devices instead of spanning all slots. An
    ``expert`` axis is made manual with ``data`` (each device passing in its own experts;
    :func:`focus_jax.models.moe.run_experts_sharded`): XLA 0.11.2's partitioner fails on a
    region manual over ``data`` with both ``expert`` and ``model`` left to it (a check failure
    in spmd_partitioner_util on 8 CPU devices at data=2, expert=2, model=2).
    """
    mesh = settings.mesh
    if mesh is None or mesh.shape["data"] == 1:
        return _step(model, state, settings)

    graphdef, params = nnx.split(model)
    manual = {"data"} | ({"expert"} if mesh.shape.get("expert", 1) > 1 else set())
    # Specs name the manual axes only: the model axis stays with the partitioner.
    param_specs = sharding.manual_param_specs(params, manual)
    state_spec = sharding.state_specs(state, kv_heads=None)
    data = PartitionSpec("data")
    log_spec = StepLog(data, data, data, data, data, PartitionSpec(), PartitionSpec())

    def shard_step(params, state: DecodeState) -> tuple[DecodeState, StepLog]:
        state = dataclasses.replace(state, cache=state.cache.to_shard("data"))
        state, log = _step(nnx.merge(graphdef, params), state, settings)
        state = dataclasses.replace(state, cache=state.cache.to_shard("data", sign=-1))
        # The slowest shard sets the pace: report the largest bucket of any shard.
        return state, dataclasses.replace(
            log, processed_bucket=jax.lax.pmax(log.processed_bucket, "data"),
            retained_bucket=jax.lax.pmax(log.retained_bucket, "data"))

    return jax.shard_map(shard_step, mesh=mesh, in_specs=(param_specs, state_spec),
                         out_specs=(state_spec, log_spec), axis_names=manual)(params, state)


def _step(model: Decoder, state: DecodeState,
          settings: DecodeSettings) -> tuple[DecodeState, StepLog]:
    """The step on one shard's slots: layers 0-1 on the processed tokens, the eviction policy,
    layers >= 2 on the retained ones, the LM head and sampler on the candidates, the unmasking
    rule, then slot states, stops and commits (the policies: :mod:`focus_jax.policies`)."""
    policies = settings.policies
    s, b = state.tokens.shape
    flat = s * b
    masked = state.slot_state == MASKED
    decoding = state.live & masked.any(axis=-1)
    committing = state.live & ~masked.any(axis=-1)

    processed = policies.processing.processed(state.live, state.slot_state,
                                              state.params.commit_refresh)
    layers = _Layers(model, settings, state)
    processed_rows = Compaction(processed.reshape(flat), settings.processed_ladder)
    x, cache, first_layers = layers.first_two(processed_rows, state.cache,
                                              kv_len=state.history + _rightmost(processed) + 1)

    if policies.eviction.evicts:
        retained = _retained(policies.eviction, state, processed, masked, processed_rows,
                             first_layers, _slot_ladder(settings.processed_ladder, b))
        # Retained rows are processed rows: re-order x and layer 1's queries to their compaction.
        retained_rows = Compaction(retained.reshape(flat), settings.retained_ladder)
        reorder = processed_rows.inverse[retained_rows.rows]
        x, q1 = x[reorder], first_layers[2][reorder]
    else:
        retained, retained_rows, q1 = processed, processed_rows, first_layers[2]
    rightmost_retained = _rightmost(retained)
    x, cache = layers.rest(retained_rows, x, q1, cache,
                           kv_len=state.history + rightmost_retained + 1)

    # The LM head runs only where a token can be chosen: the masked rows of decoding slots (the
    # others keep their tokens; the unmasking rule reads nothing else).
    candidates = retained & masked & decoding[:, None]
    token, confidence = layers.choose(candidates, retained_rows, x)

    chosen = policies.unmasking(candidates, confidence, state.params.threshold)
    tokens = jnp.where(chosen, token, state.tokens)
    slot_state = jnp.where(chosen, UNMASKED, state.slot_state)
    slot_state = policies.processing.settle(slot_state, state.slot_state, processed)
    decoded = chosen.sum(axis=-1)

    completed = decoding & ~(slot_state == MASKED).any(axis=-1)
    state = _finish_blocks(state, completed, tokens)
    fresh = jnp.full_like(tokens, settings.mask_token_id)
    state = dataclasses.replace(
        state,
        tokens=jnp.where(committing[:, None], fresh, tokens),
        slot_state=jnp.where(committing[:, None], MASKED, slot_state),
        history=jnp.where(committing, state.history + b, state.history),
        progress=jnp.where(committing, -1, jnp.maximum(state.progress, rightmost_retained)),
        block_decoded=jnp.where(committing, 0, state.block_decoded + decoded),
        block_steps=jnp.where(committing, 0, state.block_steps + (decoded > 0)),
        cache=cache,
    )
    log = StepLog(processed=processed, retained=retained, decoded=chosen, sampled=candidates,
                  live=decoding | committing, processed_bucket=processed_rows.size,
                  retained_bucket=retained_rows.size)
    return state, log


def _slot_ladder(row_ladder: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """Bucket sizes for a compaction of slots: the row ladder's buckets in whole blocks (the
    last one every slot)."""
    return tuple(sorted({-(-rows // block_size) for rows in row_ladder}))


def decoded_per_step(state: DecodeState) -> Float[Array, "s"]:
    """Each slot's tokens unmasked per decoding step so far in its active block (1 before its
    first such step): what FOCUS's retention budget scales with."""
    return jnp.where(state.block_steps > 0,
                     state.block_decoded / jnp.maximum(state.block_steps, 1), 1.0)


def _retained(eviction: Eviction, state: DecodeState, processed: Bool[Array, "s b"],
              masked: Bool[Array, "s b"], processed_rows: Compaction,
              first_layers: tuple[Array, ...], ladder: tuple[int, ...]) -> Bool[Array, "s b"]:
    """The eviction policy's retained tokens, computed for the slots that can evict only.

    Only a slot with masked processed tokens can evict any (the policy keeps every other
    processed token), and a lightly loaded engine has few such slots: 8 requests in 256 slots
    computed the importance of 256 blocks per layer, on queries gathered from all 8,192 rows.
    Those slots are compacted into the smallest bucket of ``ladder`` that holds them; their
    blocks' queries and keys (``first_layers``: q0, k0, q1, k1 in the processed rows' compact
    order) are gathered per slot and the policy runs on ``[bucket, B]``. Slots are independent
    in the policy, so the result is the same as over all slots."""
    s, b = processed.shape
    evicting = (processed & masked).any(axis=-1)
    avg = decoded_per_step(state)

    def work(slot: Int[Array, "n"], valid: Bool[Array, "n"]) -> Bool[Array, "s b"]:
        at = processed_rows.inverse[slot[:, None] * b + jnp.arange(b)]  # [n, b] compact rows
        keep = eviction.retained(processed[slot] & valid[:, None], masked[slot],
                                 tuple(a[at] for a in first_layers), state.progress[slot],
                                 avg[slot], state.params.alpha[slot])
        return jnp.zeros((s, b), bool).at[jnp.where(valid, slot, s)].set(keep, mode="drop")

    return jnp.where(evicting[:, None], Compaction(evicting, ladder).run(work), processed)


class _Layers:
    """The model's work in one step, on compacted rows of the flat ``S*B`` token axis.

    Rows stay in their compaction's compact order (a bucket's rows are a static slice), padded
    to the fixed length ``S*B`` where a bucket hands them on.
    """

    def __init__(self, model: Decoder, settings: DecodeSettings, state: DecodeState):
        s, b = state.tokens.shape
        self.model, self.settings, self.state = model, settings, state
        self.flat, self.block_size, self.slots = s * b, b, s
        self.position = (state.history[:, None] + jnp.arange(b)).reshape(s * b)
        self.slot_of_row = jnp.arange(s * b) // b

    def _padded(self, a: Array) -> Array:
        return jnp.pad(a, [(0, self.flat - a.shape[0])] + [(0, 0)] * (a.ndim - 1))

    def _cache_target(self, rows: Int[Array, "n"], valid: Bool[Array, "n"]) -> Int[Array, "n"]:
        """The slot each row writes its KV to; padding rows (and rows not kept) write nothing."""
        return jnp.where(valid, self.slot_of_row[rows], self.slots)

    def _attend_and_finish_rows(self, layer: Layer, layer_index, rows, valid, x, q,
                                cache: KVCache, kv_len, layout: SlotLayout | None = None):
        """The second half of ``layer`` (number ``layer_index``) for a bucket's rows. Padding
        rows come out with values nobody reads: only kept rows are read after a layer (the next
        layer's kept rows, the eviction's processed ones, the head's candidates), and no row
        writes the cache here. ``layout``: the rows' slot layout, if computed once for several
        layers."""
        attn = cache.attend(q, rows, valid, layer_index, kv_len, block_size=self.block_size,
                            impl=self.settings.kernels, mesh=self.settings.mesh, layout=layout)
        return layer.finish(x, attn, valid, self.settings.mesh)

    # Layers 0-1 run in two bucketed halves with the cache write between them, outside the
    # bucket switch: a switch that returned the cache would make XLA allocate (or copy) the
    # whole cache per branch. Layers are read out of the weight stack inside the branches,
    # next to their matmuls: a layer sliced outside would enter every branch as a copy.
    def _project(self, rows_of: Compaction, layer_index: int, x: Array, cache: KVCache):
        def work(rows, valid, x):
            q, k, v = self.model.layer(layer_index).qkv(x[:rows.shape[0]], self.position[rows])
            return self._padded(q), self._padded(k), self._padded(v)

        q, k, v = rows_of.run(work, x)
        target = self._cache_target(rows_of.rows, rows_of.kept_in_order)
        return q, k, cache.write(layer_index, target, self.position[rows_of.rows], k, v)

    def _attend_and_finish(self, rows_of: Compaction, layer_index: int, x, q, cache, kv_len):
        def work(rows, valid, x, q, cache: KVCache):
            size = rows.shape[0]
            finished = self._attend_and_finish_rows(self.model.layer(layer_index), layer_index,
                                                    rows, valid, x[:size], q[:size], cache, kv_len)
            return jax.lax.dynamic_update_slice_in_dim(x, finished, 0, axis=0)

        return rows_of.run(work, x, q, cache)

    def first_two(self, rows_of: Compaction, cache: KVCache, kv_len: Int[Array, "s"]):
        """Layer 0 and layer 1 up to its Q/K/V projections for the processed rows (KV written in
        both). Returns their hidden states, the cache, and (q0, k0, q1, k1) in compact order."""
        x = self.model.embed_tokens(self.state.tokens.reshape(self.flat)[rows_of.rows])
        q0, k0, cache = self._project(rows_of, 0, x, cache)
        x = self._attend_and_finish(rows_of, 0, x, q0, cache, kv_len)
        q1, k1, cache = self._project(rows_of, 1, x, cache)
        return x, cache, (q0, k0, q1, k1)

    def rest(self, rows_of: Compaction, x, q1, cache: KVCache, kv_len: Int[Array, "s"]):
        """The retained rows finish layer 1 (evicted ones stop here) and run layers >= 2."""
        x = self._attend_and_finish(rows_of, 1, x, q1, cache, kv_len)

        # Layers >= 2 run the same rows, so one bucket runs them all (KV writes included).
        def later_layers(rows, valid, carry):
            x, cache = carry
            row_position, target = self.position[rows], self._cache_target(rows, valid)
            # Every layer attends with the same rows: their slot layout is derived once.
            layout = slot_layout(rows, valid, self.slots, self.block_size)

            # The layer index is the loop counter, not an element of a scanned arange: XLA's GPU
            # dynamic-slice fusion (on with compilation.GPU_COMPILER_OPTIONS), which lets the GEMMs
            # read each layer's weights in place in the stack, takes only offsets computed from
            # a loop counter (docs/benchmarks.md, "Weight reads").
            def layer(layer_index, layer: Layer, carry):
                h, cache = carry
                q, k, v = layer.qkv(h, row_position)
                cache = cache.write(layer_index, target, row_position, k, v)
                return self._attend_and_finish_rows(layer, layer_index, rows, valid, h, q, cache,
                                                    kv_len, layout), cache

            h, cache = self.model.fori_layers(2, self.model.config.num_layers, layer,
                                              (x[:rows.shape[0]], cache),
                                              unroll=self.settings.unroll_layers)
            return jax.lax.dynamic_update_slice_in_dim(x, h, 0, axis=0), cache

        return rows_of.run_in_place(later_layers, (x, cache))

    def choose(self, candidates: Bool[Array, "s b"], retained_rows: Compaction,
               x: Array) -> tuple[Int[Array, "s b"], Float[Array, "s b"]]:
        """LM head and sampler on the candidate rows (compacted again): each row's token and
        confidence, in the ``[s, b]`` layout (other rows: zeros)."""
        candidate_rows = Compaction(candidates.reshape(self.flat), self.settings.retained_ladder)
        params = self.state.params

        def head(rows, valid, x):
            slot = self.slot_of_row[rows]
            sampling = RowSampling(temperature=params.temperature[slot], top_k=params.top_k[slot],
                                   top_p=params.top_p[slot], seed=params.seed[slot],
                                   position=self.position[rows],
                                   draw=self.state.block_steps[slot])
            token, confidence = _choose_tokens(self.model, self.settings.policies.sampler,
                                               x[retained_rows.inverse[rows]], sampling)
            return self._padded(token), self._padded(confidence)

        token, confidence = (candidate_rows.to_flat(a) for a in candidate_rows.run(head, x))
        return token.reshape(self.slots, -1), confidence.reshape(self.slots, -1)


HEAD_CHUNK = 512


def _choose_tokens(model: Decoder, sampler, x: Array,
                   rows: RowSampling) -> tuple[Int[Array, "n"], Array]:
    """LM head and sampling for the hidden states ``x`` of ``n`` rows, ``HEAD_CHUNK`` rows at a
    time: float32 logits of a large vocabulary for every row at once would take gigabytes (and
    several temporaries). Fewer rows than a chunk run as they are: padded to a whole chunk, a
    lightly loaded step's 64-row bucket computed 512 rows of logits."""
    n = x.shape[0]
    size = min(HEAD_CHUNK, n)
    chunks = -(-n // size)
    pad = chunks * size - n

    def chunked(a: Array) -> Array:
        return jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(chunks, size,
                                                                          *a.shape[1:])

    def chunk(x_and_rows):
        x_chunk, rows_chunk = x_and_rows
        return sampler(model.head(x_chunk), rows_chunk)

    token, confidence = jax.lax.map(chunk, (chunked(x), jax.tree.map(chunked, rows)))
    return token.reshape(-1)[:n], confidence.reshape(-1)[:n]


def _finish_blocks(state: DecodeState, completed: Bool[Array, "s"],
                   tokens: Int[Array, "s b"]) -> DecodeState:
    """Record fully unmasked blocks and end the requests that stop in them (SPEC 3, Stop)."""
    s, b = tokens.shape
    m = state.sequence.shape[1]
    position = state.history[:, None] + jnp.arange(b)
    target = jnp.where(completed[:, None], jnp.arange(s)[:, None], s)
    sequence = state.sequence.at[target, position].set(tokens, mode="drop")

    generated = position >= state.prompt_len[:, None]
    is_stop = generated & (tokens[:, :, None] == state.params.stop_ids[:, None, :]).any(axis=-1)
    has_stop = is_stop.any(axis=-1)
    stop_len = state.history + jnp.argmax(is_stop, axis=-1) - state.prompt_len
    block_end_len = state.history + b - state.prompt_len
    max_new = state.params.max_new
    # The cache always has room for max_new tokens (the engine checks); the last test only
    # keeps a slot from writing past its cache if it is handed too small a one.
    reached = (block_end_len >= max_new) | (state.history + 2 * b > m)
    finished = completed & (has_stop | reached)
    out_len = jnp.minimum(jnp.where(has_stop, stop_len, block_end_len), max_new)
    return dataclasses.replace(
        state,
        sequence=sequence,
        live=state.live & ~finished,
        out_len=jnp.where(finished, out_len, state.out_len),
    )


def decode_round(model: Decoder, state: DecodeState, settings: DecodeSettings, max_steps: int,
                 stop_on_finish: Bool[Array, ""], step_limit: Int[Array, ""],
                 stop_on_first_output: Bool[Array, ""] | bool = False,
                 interrupt_channel: Int[Array, ""] | int = interrupts.NO_CHANNEL,
                 ) -> tuple[DecodeState, StepLog, Int[Array, ""]]:
    """Run up to ``step_limit`` (at most ``max_steps``) steps in one
    ``lax.while_loop``: until no slot is live, or (with ``stop_on_finish``) as soon as some
    request finishes so its slot can be refilled, or (with ``stop_on_first_output``) as soon as
    some request commits the first block holding output, so that it can be streamed at once.
    ``step_limit`` and both switches are run-time values: rounds of any length up to
    ``max_steps`` share one compiled program. With ``settings.interruptible`` the round also
    ends after any step once the host sets the interrupt of ``interrupt_channel``
    (:mod:`focus_jax.interrupts`); it runs at least one step.

    Returns the state, the per-step logs ``[max_steps, ...]`` (rows past the steps run are
    zeros) and the number of steps run.
    """
    limit = jnp.minimum(step_limit, max_steps)  # the logs hold max_steps steps
    s, b = state.tokens.shape
    empty = StepLog(
        *(jnp.zeros((max_steps, s, b), bool) for _ in range(4)), jnp.zeros((max_steps, s), bool),
        jnp.zeros((max_steps,), jnp.int32), jnp.zeros((max_steps,), jnp.int32))
    live_at_start = state.live
    # Slots whose committed positions do not yet reach past the prompt: no output streamed yet.
    no_output_at_start = state.live & (state.history <= state.prompt_len)

    def keep_going(carry) -> Array:
        state, _, i = carry
        someone_finished = (live_at_start & ~state.live).any()
        first_output = (no_output_at_start
                        & (~state.live | (state.history > state.prompt_len))).any()
        stop = (stop_on_finish & someone_finished) | (stop_on_first_output & first_output)
        if settings.interruptible:
            stop |= (i > 0) & interrupts.requested(jnp.asarray(interrupt_channel, jnp.int32))
        return (i < limit) & state.live.any() & ~stop

    def one_step(carry):
        state, logs, i = carry
        state, log = step(model, state, settings)
        logs = jax.tree.map(lambda all_, one: all_.at[i].set(one), logs, log)
        return state, logs, i + 1

    return jax.lax.while_loop(keep_going, one_step, (state, empty, jnp.int32(0)))


_LOG_COUNTS = ("processed", "retained", "decoded", "sampled")
"""The per-position step-log fields the host reads as counts per step and slot
(:func:`pack_round`)."""

_SLOT_COLUMNS = ("live", "out_len", "history", "steps", "window_start")
""":func:`pack_round`'s leading columns, one each; ``_STEP_COLUMNS`` follow, ``T`` each."""
_STEP_COLUMNS = (*_LOG_COUNTS, "step_live", "processed_bucket", "retained_bucket")


@dataclasses.dataclass(frozen=True)
class RoundResults:
    """What the host reads after a round (:func:`unpack_round`), NumPy arrays.

    ``processed``, ``retained``, ``decoded``, ``sampled``, ``step_live``: ``[max_steps, S]``,
    per step and slot the positions of each step-log field (``step_live``: the slot took part);
    ``processed_bucket``, ``retained_bucket``: ``[max_steps]``. ``window``: ``[S, W]``, each
    slot's sequence from ``window_start`` (its history when the round began) on, ``W = min(
    max_steps * B, M)`` positions: everything a round can commit (one block per step at most).
    """

    steps: int
    live: np.ndarray
    out_len: np.ndarray
    history: np.ndarray
    processed: np.ndarray
    retained: np.ndarray
    decoded: np.ndarray
    sampled: np.ndarray
    step_live: np.ndarray
    processed_bucket: np.ndarray
    retained_bucket: np.ndarray
    window_start: np.ndarray
    window: np.ndarray

    def tokens(self, slot: int, known: list[int], start: int, end: int) -> list[int]:
        """The slot's tokens at positions ``[start, end)``, given ``known``, those from
        ``start`` on that the host already has (an earlier round's), and the window."""
        have = start + len(known)
        if end <= have:
            return known[:max(0, end - start)]
        origin = int(self.window_start[slot])
        lo, hi = have - origin, end - origin
        if lo < 0 or hi > self.window.shape[1]:
            raise RuntimeError(f"slot {slot}: positions {have}-{end} lie outside the round's "
                               f"window {origin}+{self.window.shape[1]}")
        return known + self.window[slot, lo:hi].tolist()


def window_width(max_steps: int, block_size: int, positions: int) -> int:
    """Sequence positions per slot in a round's results (:class:`RoundResults`)."""
    return min(max_steps * block_size, positions)


def packed_width(max_steps: int, block_size: int, positions: int) -> int:
    """Columns of :func:`pack_round`'s array."""
    return (len(_SLOT_COLUMNS) + len(_STEP_COLUMNS) * max_steps
            + window_width(max_steps, block_size, positions))


def pack_round(state: DecodeState, logs: StepLog, ran: Int[Array, ""],
               history_at_start: Int[Array, "s"]) -> Int[Array, "s w"]:
    """What the host reads after a round, as one int32 array (one transfer instead of one per
    field; each costs the host a round trip). A row per slot (split over slots like the state):
    ``live, out_len, history, ran, history_at_start``, the ``T`` per-step counts of each field
    of :data:`_LOG_COUNTS`, the ``T`` per-step ``live`` log, the ``T`` processed and ``T``
    retained buckets (the same in every row), then the slot's sequence from
    ``history_at_start`` on (:func:`window_width` positions: not the whole sequence, most of
    which the host already has). :func:`unpack_round` reads it back."""
    s, m = state.sequence.shape
    t, _, b = logs.processed.shape
    width = window_width(t, b, m)
    at = jnp.minimum(history_at_start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :],
                     m - 1)  # past the cache: never read

    def every_row(x: Array) -> Array:
        return jnp.broadcast_to(x, (s, *jnp.shape(x)))

    slot_columns = (state.live, state.out_len, state.history, every_row(ran), history_at_start)
    step_columns = (*(getattr(logs, name).sum(-1).T for name in _LOG_COUNTS), logs.live.T,
                    every_row(logs.processed_bucket), every_row(logs.retained_bucket))
    columns = (*(c[:, None] for c in slot_columns), *step_columns,
               jnp.take_along_axis(state.sequence, at, axis=1))
    return jnp.concatenate([c.astype(jnp.int32) for c in columns], axis=1)


def unpack_round(packed: np.ndarray, max_steps: int) -> RoundResults:
    """:func:`pack_round`'s array, on the host."""
    ends = np.cumsum([1] * len(_SLOT_COLUMNS) + [max_steps] * len(_STEP_COLUMNS))
    *parts, window = np.split(packed, ends, axis=1)
    fields = dict(zip(_SLOT_COLUMNS + _STEP_COLUMNS, parts, strict=True))
    results = {name: fields[name][:, 0] for name in _SLOT_COLUMNS}        # [S]
    results |= {name: fields[name].T for name in (*_LOG_COUNTS, "step_live")}  # [T, S]
    results |= {name: fields[name][0] for name in ("processed_bucket", "retained_bucket")}
    results |= {"steps": int(results["steps"][0]), "live": results["live"].astype(bool),
                "step_live": results["step_live"].astype(bool)}
    return RoundResults(**results, window=window)


def tokens_per_step(block_size: int, denoising_steps: int | None) -> int:
    """Tokens the static and sequential rules unmask per step: ``ceil(B / steps)``."""
    return math.ceil(block_size / (denoising_steps or block_size))
