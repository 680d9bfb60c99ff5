"""Block-diffusion decoding on the device: the decode state, prefill and the denoising step.

Everything here is a pure function of pytrees, compiled once per shape. The step
(SPEC_FOCUS sections 3-6) runs every slot's active block in one call:

1. **processed** tokens (the whole block in ``baseline``; the not-yet-cached slots with the
   delayed KV cache) are compacted into the smallest bucket that holds them and run through
   layer 0 and the first half of layer 1 (their KV written in both);
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
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Bool, Int

from focus_jax import focus, sharding
from focus_jax.cache import KVCache
from focus_jax.compaction import Compaction
from focus_jax.config import ModelConfig
from focus_jax.models.qwen3 import Decoder, forward
from focus_jax.unmasking import Sampler, unmask
from pallas_kernels.focus_importance import focus_importance
from pallas_kernels.ragged_attention import ragged_attention

MASKED, UNMASKED, CACHED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Everything static about a decode program (hashable: a jit static argument)."""

    mode: str
    block_size: int
    mask_token_id: int
    threshold: float
    alpha: float
    unmasking: str
    per_step: int
    sampler: Sampler
    processed_ladder: tuple[int, ...]
    """Bucket sizes for the processed tokens (rows of the flat ``S*B`` token axis)."""
    retained_ladder: tuple[int, ...]
    """Bucket sizes for the retained tokens."""
    stop_token_ids: tuple[int, ...]
    kernels: str | None = None
    """Kernel implementation for attention and importance (``None``: the platform default)."""
    unroll_layers: bool = False
    """Unroll the layer scan (for cost analysis; compile time then grows with depth)."""
    mesh: Mesh | None = None
    """The mesh the state lives on. Where its ``data`` axis splits the slots, each data shard
    runs the step on its own slots (its own compaction and buckets; the ladders count one
    shard's rows)."""

    @property
    def delayed_cache(self) -> bool:
        return self.mode != "baseline"


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
    max_new: Int[Array, "s"]
    out_len: Int[Array, "s"]
    """Generated tokens to return, set when the request finishes."""
    sequence: Int[Array, "s m"]
    """Prompt and completed blocks of each slot."""
    rng: Array
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
    retained_bucket: Int[Array, ""]


def init_state(cfg: ModelConfig, slots: int, positions: int, block_size: int,
               mask_token_id: int, seed: int = 0) -> DecodeState:
    """An engine state with every slot free."""
    if positions % block_size:
        raise ValueError(f"cache positions {positions} must be a multiple of the block size")
    def zeros() -> Array:  # a buffer per field: the state is donated, and buffers must not alias
        return jnp.zeros((slots,), jnp.int32)

    return DecodeState(
        tokens=jnp.full((slots, block_size), mask_token_id, jnp.int32),
        slot_state=jnp.zeros((slots, block_size), jnp.int32),
        history=zeros(), progress=zeros() - 1, block_decoded=zeros(), block_steps=zeros(),
        live=jnp.zeros((slots,), bool), prompt_len=zeros(), max_new=zeros(), out_len=zeros(),
        sequence=jnp.full((slots, positions), mask_token_id, jnp.int32),
        rng=jax.random.PRNGKey(seed),  # raw uint32 key data: plain to move between hosts
        cache=KVCache.create(cfg, slots, positions),
    )


def prefill(model: Decoder, state: DecodeState, tokens: Int[Array, "n t"],
            length: Int[Array, "n"], slot: Int[Array, "n"], max_new: Int[Array, "n"],
            block_size: int, mask_token_id: int) -> DecodeState:
    """Start requests in slots (SPEC 2): write the KV of every full prompt block but the last.

    ``tokens`` are prompts right-padded to a common length (a multiple of B); rows whose ``slot``
    is out of range are padding and change nothing. The block holding the prompt tail (or a
    fresh block when the prompt fills its blocks) becomes the active block, its prompt positions
    ``UNMASKED``.
    """
    b, mask = block_size, mask_token_id
    n, t = tokens.shape
    history = (length // b) * b
    _, (k, v) = forward(model, tokens, b)
    cache = state.cache.write_prefix(slot, history, k, v)

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
        max_new=put(state.max_new, max_new),
        out_len=put(state.out_len, jnp.zeros((n,))),
        sequence=put(state.sequence, row),
        cache=cache,
    )


def _rightmost(flags: Bool[Array, "s b"]) -> Int[Array, "s"]:
    return jnp.max(jnp.where(flags, jnp.arange(flags.shape[-1]), -1), axis=-1)


def step(model: Decoder, state: DecodeState,
         settings: DecodeSettings) -> tuple[DecodeState, StepLog]:
    """One denoising (or commit) step for every live slot.

    With a ``data`` axis in ``settings.mesh``, every data shard steps its own slots
    (``shard_map`` over ``data``; the ``model`` axis stays with the partitioner): compaction,
    buckets and row gathers stay on the shard's devices instead of spanning all slots.
    """
    mesh = settings.mesh
    if mesh is None or mesh.shape["data"] == 1:
        return _step(model, state, settings, row_offset=0)

    graphdef, params = nnx.split(model)
    # Specs name the manual axis only: the model axis stays with the partitioner.
    state_spec = sharding.state_specs(state, kv_heads=None)
    data = PartitionSpec("data")
    log_spec = StepLog(data, data, data, data, data, PartitionSpec(), PartitionSpec())

    def shard_step(params, state: DecodeState) -> tuple[DecodeState, StepLog]:
        # Rows are numbered globally so that sampling keys match the unsharded step.
        offset = jax.lax.axis_index("data") * state.tokens.size
        state, log = _step(nnx.merge(graphdef, params), state, settings, row_offset=offset)
        # The slowest shard sets the pace: report the largest bucket of any shard.
        return state, dataclasses.replace(
            log, processed_bucket=jax.lax.pmax(log.processed_bucket, "data"),
            retained_bucket=jax.lax.pmax(log.retained_bucket, "data"))

    return jax.shard_map(shard_step, mesh=mesh, in_specs=(PartitionSpec(), state_spec),
                         out_specs=(state_spec, log_spec), axis_names={"data"})(params, state)


def _step(model: Decoder, state: DecodeState, settings: DecodeSettings,
          row_offset: Int[Array, ""] | int) -> tuple[DecodeState, StepLog]:
    s, b = state.tokens.shape
    flat = s * b
    index = jnp.arange(b)
    masked = state.slot_state == MASKED
    decoding = state.live & masked.any(axis=-1)
    committing = state.live & ~masked.any(axis=-1)

    processed = jnp.broadcast_to(state.live[:, None], (s, b))
    if settings.delayed_cache:
        processed = processed & (state.slot_state != CACHED)
    # Layers 0-1 write KV for every processed token and attend up to the rightmost of them.
    kv_len_processed = state.history + _rightmost(processed) + 1

    position = (state.history[:, None] + index).reshape(flat)
    slot_of_row = jnp.arange(flat) // b

    # Rows stay in their compaction's compact order (a bucket's rows are a static slice), padded
    # to the fixed length S*B where a bucket hands them on.
    def padded(a: Array) -> Array:
        return jnp.pad(a, [(0, flat - a.shape[0])] + [(0, 0)] * (a.ndim - 1))

    def cache_target(rows, valid):
        """The slot each row writes its KV to; padding rows (and rows not kept) write nothing."""
        return jnp.where(valid, slot_of_row[rows], s)

    def attend_and_finish_rows(layer_index, rows, valid, x, q, cache: KVCache, kv_len):
        """The second half of a layer for a bucket's rows (padding rows pass through)."""
        attn = ragged_attention(q, rows, valid, cache.k, cache.v, layer_index, kv_len,
                                block_size=b, impl=settings.kernels)
        return jnp.where(valid[:, None], model.layer(layer_index).finish(x, attn), x)

    # Layers 0-1 run in two bucketed halves with the cache write between them, outside the
    # bucket switch: a switch that returned the cache would make XLA allocate (or copy) the
    # whole cache per branch. Layers are read out of the weight stack inside the branches,
    # next to their matmuls: a layer sliced outside would enter every branch as a copy.
    def project(rows_of: Compaction, layer_index, x, cache: KVCache):
        def work(rows, valid, x):
            q, k, v = model.layer(layer_index).qkv(x[:rows.shape[0]], position[rows])
            return padded(q), padded(k), padded(v)

        q, k, v = rows_of.run(work, x)
        target = cache_target(rows_of.rows, rows_of.kept_in_order)
        return q, k, cache.write(layer_index, target, position[rows_of.rows], k, v)

    def attend_and_finish(rows_of: Compaction, layer_index, x, q, cache: KVCache, kv_len):
        def work(rows, valid, x, q, cache: KVCache):
            size = rows.shape[0]
            finished = attend_and_finish_rows(layer_index, rows, valid, x[:size], q[:size], cache,
                                              kv_len)
            return jax.lax.dynamic_update_slice_in_dim(x, finished, 0, axis=0)

        return rows_of.run(work, x, q, cache)

    processed_rows = Compaction(processed.reshape(flat), settings.processed_ladder)
    x = model.embed_tokens(state.tokens.reshape(flat)[processed_rows.rows])
    q0, k0, cache = project(processed_rows, 0, x, state.cache)
    x = attend_and_finish(processed_rows, 0, x, q0, cache, kv_len_processed)
    q1, k1, cache = project(processed_rows, 1, x, cache)

    if settings.mode == "focus":
        def blocks(a):
            return processed_rows.to_flat(a).reshape(s, b, *a.shape[1:])

        masked_processed = processed & masked
        def importance(q, k):
            return focus_importance(blocks(q), blocks(k), masked_processed, impl=settings.kernels)

        delta = importance(q1, k1) - importance(q0, k0)
        avg = jnp.where(state.block_steps > 0,
                        state.block_decoded / jnp.maximum(state.block_steps, 1), 1.0)
        retained = processed & ~masked | focus.select_retained(
            delta, masked_processed, state.progress, avg, settings.alpha)
        # Retained rows are processed rows: re-order x and layer 1's queries to their compaction.
        retained_rows = Compaction(retained.reshape(flat), settings.retained_ladder)
        reorder = processed_rows.inverse[retained_rows.rows]
        x, q1 = x[reorder], q1[reorder]
    else:
        retained, retained_rows = processed, processed_rows
    rightmost_retained = _rightmost(retained)
    kv_len_retained = state.history + rightmost_retained + 1
    step_key, next_key = jax.random.split(state.rng)

    # Retained tokens finish layer 1 (evicted ones stop here), then run layers >= 2.
    x = attend_and_finish(retained_rows, 1, x, q1, cache, kv_len_retained)

    # Layers >= 2 run the same rows, so one bucket runs them all (KV writes included).
    def later_layers(rows, valid, carry):
        x, cache = carry
        row_position, target = position[rows], cache_target(rows, valid)

        # The layer index is the loop counter, not an element of a scanned arange: XLA's GPU
        # dynamic-slice fusion (on with compilation.GPU_COMPILER_OPTIONS), which lets the GEMMs read
        # each layer's weights in place in the stack, takes only offsets computed from a loop
        # counter (docs/benchmarks.md, "Weight reads").
        def layer(layer_index, carry):
            h, cache = carry
            q, k, v = model.layer(layer_index).qkv(h, row_position)
            cache = cache.write(layer_index, target, row_position, k, v)
            return attend_and_finish_rows(layer_index, rows, valid, h, q, cache,
                                          kv_len_retained), cache

        h, cache = jax.lax.fori_loop(2, model.config.num_layers, layer, (x[:rows.shape[0]], cache),
                                     unroll=settings.unroll_layers)
        return jax.lax.dynamic_update_slice_in_dim(x, h, 0, axis=0), cache

    x, cache = retained_rows.run_in_place(later_layers, (x, cache))

    # The LM head runs only where a token can be chosen: the masked rows of decoding slots (the
    # others keep their tokens; unmask reads nothing else).
    candidates = retained & masked & decoding[:, None]
    candidate_rows = Compaction(candidates.reshape(flat), settings.retained_ladder)

    def head(rows, valid, x):
        token, confidence = _choose_tokens(model, settings.sampler, x[retained_rows.inverse[rows]],
                                           rows, step_key, row_offset)
        return padded(token), padded(confidence)

    token, confidence = (candidate_rows.to_flat(a) for a in candidate_rows.run(head, x))

    chosen = unmask(candidates, confidence.reshape(s, b), settings.unmasking,
                    settings.threshold, settings.per_step)
    tokens = jnp.where(chosen, token.reshape(s, b), state.tokens)
    slot_state = jnp.where(chosen, UNMASKED, state.slot_state)
    if settings.delayed_cache:
        # From the states at this step's input: a token decoded now is re-run once with its real
        # embedding next step; a decoded token right before a mask stays live.
        settled = ~masked & jnp.pad(~masked[:, 1:], ((0, 0), (0, 1)), constant_values=True)
        slot_state = jnp.where(processed & settled, CACHED, slot_state)
    decoded = chosen.sum(axis=-1)

    completed = decoding & ~(slot_state == MASKED).any(axis=-1)
    state = _finish_blocks(state, completed, tokens, settings)
    fresh = jnp.full_like(tokens, settings.mask_token_id)
    state = dataclasses.replace(
        state,
        tokens=jnp.where(committing[:, None], fresh, tokens),
        slot_state=jnp.where(committing[:, None], MASKED, slot_state),
        history=jnp.where(committing, state.history + b, state.history),
        progress=jnp.where(committing, -1, jnp.maximum(state.progress, rightmost_retained)),
        block_decoded=jnp.where(committing, 0, state.block_decoded + decoded),
        block_steps=jnp.where(committing, 0, state.block_steps + (decoded > 0)),
        rng=next_key,
        cache=cache,
    )
    log = StepLog(processed=processed, retained=retained, decoded=chosen, sampled=candidates,
                  live=decoding | committing, processed_bucket=processed_rows.index,
                  retained_bucket=retained_rows.index)
    return state, log


HEAD_CHUNK = 512


def _choose_tokens(model: Decoder, sampler: Sampler, x: Array, rows: Int[Array, "n"],
                   key: Array, row_offset: Int[Array, ""] | int) -> tuple[Int[Array, "n"], Array]:
    """LM head and sampling for the hidden states ``x`` of flat rows ``rows`` (which name the
    sampling keys), ``HEAD_CHUNK`` rows at a time: float32 logits of a large vocabulary for
    every row at once would take gigabytes (and several temporaries)."""
    n = rows.shape[0]
    chunks = -(-n // HEAD_CHUNK)
    pad = chunks * HEAD_CHUNK - n
    rows_chunks = jnp.pad(rows, (0, pad)).reshape(chunks, -1)
    x_chunks = jnp.pad(x, ((0, pad), (0, 0))).reshape(chunks, HEAD_CHUNK, -1)

    def chunk(rows_and_x):
        rows_chunk, x_chunk = rows_and_x
        keys = jax.vmap(lambda r: jax.random.fold_in(key, r + row_offset))(rows_chunk)
        return sampler(model.head(x_chunk), keys)

    token, confidence = jax.lax.map(chunk, (rows_chunks, x_chunks))
    return token.reshape(-1)[:n], confidence.reshape(-1)[:n]


def _finish_blocks(state: DecodeState, completed: Bool[Array, "s"], tokens: Int[Array, "s b"],
                   settings: DecodeSettings) -> DecodeState:
    """Record fully unmasked blocks and end the requests that stop in them (SPEC 3, Stop)."""
    s, b = tokens.shape
    m = state.sequence.shape[1]
    position = state.history[:, None] + jnp.arange(b)
    target = jnp.where(completed[:, None], jnp.arange(s)[:, None], s)
    sequence = state.sequence.at[target, position].set(tokens, mode="drop")

    generated = position >= state.prompt_len[:, None]
    stop_ids = jnp.asarray(settings.stop_token_ids or (-1,), jnp.int32)
    is_stop = generated & jnp.isin(tokens, stop_ids)
    has_stop = is_stop.any(axis=-1)
    stop_len = state.history + jnp.argmax(is_stop, axis=-1) - state.prompt_len
    block_end_len = state.history + b - state.prompt_len
    # The cache always has room for max_new tokens (the engine checks); the last test only
    # keeps a slot from writing past its cache if it is handed too small a one.
    reached = (block_end_len >= state.max_new) | (state.history + 2 * b > m)
    finished = completed & (has_stop | reached)
    out_len = jnp.minimum(jnp.where(has_stop, stop_len, block_end_len), state.max_new)
    return dataclasses.replace(
        state,
        sequence=sequence,
        live=state.live & ~finished,
        out_len=jnp.where(finished, out_len, state.out_len),
    )


def decode_round(model: Decoder, state: DecodeState, settings: DecodeSettings, max_steps: int,
                 stop_on_finish: Bool[Array, ""]) -> tuple[DecodeState, StepLog, Int[Array, ""]]:
    """Run up to ``max_steps`` steps in one ``lax.while_loop``: until no slot is live, or (with
    ``stop_on_finish``) as soon as some request finishes so its slot can be refilled.

    Returns the state, the per-step logs ``[max_steps, ...]`` and the number of steps run.
    """
    s, b = state.tokens.shape
    empty = StepLog(*(jnp.zeros((max_steps, s, b), bool) for _ in range(4)),
                    jnp.zeros((max_steps, s), bool), jnp.zeros((max_steps,), jnp.int32),
                    jnp.zeros((max_steps,), jnp.int32))
    live_at_start = state.live

    def keep_going(carry) -> Array:
        state, _, i = carry
        someone_finished = (live_at_start & ~state.live).any()
        return (i < max_steps) & state.live.any() & ~(stop_on_finish & someone_finished)

    def one_step(carry):
        state, logs, i = carry
        state, log = step(model, state, settings)
        logs = jax.tree.map(lambda all_, one: all_.at[i].set(one), logs, log)
        return state, logs, i + 1

    return jax.lax.while_loop(keep_going, one_step, (state, empty, jnp.int32(0)))


def tokens_per_step(block_size: int, denoising_steps: int | None) -> int:
    """Tokens the static and sequential rules unmask per step: ``ceil(B / steps)``."""
    return math.ceil(block_size / (denoising_steps or block_size))
