"""The serving engine: a request queue, ``S`` slots, continuous batching at block boundaries.

The host side is plain Python: it prefills queued requests into free slots, runs the compiled
decode program for a round of steps (``lax.while_loop`` on the device, no host round trip per
step), collects finished requests, streams new tokens and keeps statistics.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from focus_jax import compilation, decoding, sharding
from focus_jax.compaction import bucket_ladder
from focus_jax.config import ConfigError, GenerationConfig
from focus_jax.distributed import to_host
from focus_jax.model import Model
from focus_jax.prompts import token_ids
from focus_jax.unmasking import Sampler


def token_layer_split(processed: float, retained: float, num_layers: int) -> tuple[float, float]:
    """Token-layers through layers 0-1 (every processed token) and through layers >= 2 (the
    retained ones), from token counts (or counts per step, or per generated token)."""
    return 2 * processed, (num_layers - 2) * retained


@dataclasses.dataclass
class RequestStats:
    """Per-request statistics. Lists hold one entry per denoising step (commit steps excluded)."""

    steps: int = 0
    """All steps the request took part in, commit steps included."""
    decoded_per_step: list[int] = dataclasses.field(default_factory=list)
    processed_per_step: list[int] = dataclasses.field(default_factory=list)
    retained_per_step: list[int] = dataclasses.field(default_factory=list)
    processed_tokens: int = 0
    """Token-steps through layers 0-1 over all its steps, commit steps included."""
    retained_tokens: int = 0
    """Token-steps through layers >= 2 over all its steps, commit steps included."""

    @property
    def denoising_steps(self) -> int:
        return len(self.decoded_per_step)

    @property
    def mean_decoded_per_step(self) -> float:
        return float(np.mean(self.decoded_per_step)) if self.decoded_per_step else 0.0


@dataclasses.dataclass
class Result:
    """One finished request."""

    token_ids: list[int]
    text: str | None
    finish_reason: str
    """``stop`` (a stop token ended it) or ``length`` (max_new_tokens reached)."""
    prompt_tokens: int
    stats: RequestStats


@dataclasses.dataclass
class RunStats:
    """Statistics of everything the engine ran (all requests together)."""

    steps: int = 0
    rounds: int = 0
    generated_tokens: int = 0
    processed_tokens: int = 0
    """Token-steps through layers 0-1."""
    retained_tokens: int = 0
    """Token-steps through layers >= 2."""
    decoded_tokens: int = 0
    sampled_tokens: int = 0
    """Token-steps through the LM head."""
    processed_buckets: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Steps per bucket size (rows) of the processed-token compaction."""
    retained_buckets: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Steps per bucket size (rows) of the retained-token compaction."""
    wall_seconds: float = 0.0
    decode_seconds: float = 0.0
    """Wall time from handing a decode round to the device until its results are on the host."""
    prefill_seconds: float = 0.0
    """Wall time from handing prefills to the device until they are done."""
    host_seconds: float = 0.0
    """Wall time of host work between rounds (statistics, streaming, building prefill batches):
    the device has nothing queued then."""

    def token_layers(self, num_layers: int) -> int:
        """Token-layers computed: processed tokens through layers 0-1, retained through the rest."""
        return sum(token_layer_split(self.processed_tokens, self.retained_tokens, num_layers))

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    on_tokens: Callable[[int, list[int]], None] | None
    stats: RequestStats = dataclasses.field(default_factory=RequestStats)
    streamed: int = 0


class RequestError(ValueError):
    """A request the engine cannot serve (the message says why); other requests go on."""


def cache_length(block_size: int, positions: int) -> int:
    """The smallest ``B * 2^k`` that holds ``positions``: cache lengths from a few sizes, so that
    repeated calls with different prompts reuse compiled programs."""
    size = block_size
    while size < positions:
        size *= 2
    return size


def prompt_buckets(block_size: int, positions: int) -> tuple[int, ...]:
    """Padded lengths ``B * 2^k`` and ``B * 3 * 2^(k-1)`` below ``positions``, and ``positions``
    itself (B, 2B, 3B, 4B, 6B, 8B, 12B, ...).

    Prefill pads prompts to these: a prompt computes at most 1.5 times its length (2 times for
    the shortest, at B), from a few compilations. On the bench's 256 prompts (48,610 tokens)
    prefill computes 62,208 padded tokens instead of the 73,216 of ``B * 2^k`` alone.
    """
    sizes, size = {positions}, block_size
    while size < positions:
        sizes.add(size)
        if size * 3 // 2 < positions and size > block_size:
            sizes.add(size * 3 // 2)
        size *= 2
    return tuple(sorted(sizes))


class Engine:
    """Continuous-batching block-diffusion decoder over ``slots`` concurrent requests.

    >>> engine = Engine(model, GenerationConfig(mode="focus"), slots=8, cache_len=1024)
    >>> rid = engine.submit(prompt_ids, max_new_tokens=128)
    >>> results = engine.run()   # {rid: Result}
    """

    def __init__(self, model: Model, config: GenerationConfig, *, slots: int, cache_len: int,
                 prefill_batch: int | None = None, mesh: Mesh | None = None):
        cfg = model.config
        block = config.block_size or cfg.block_size
        if block is None:
            raise ConfigError("the model's config.json names no block_size: set "
                              "GenerationConfig(block_size=...) (4, 8, 16, 32 or 64)")
        if cfg.block_size is not None and block != cfg.block_size:
            raise ConfigError(f"block_size {block} does not match the model, which was trained "
                              f"with block size {cfg.block_size}")
        if cfg.num_layers < 2:
            raise ConfigError("decoding needs a model with at least 2 layers")
        if slots < 1:
            raise ConfigError(f"slots must be >= 1, got {slots}")
        self.model = model
        self.config = config
        self.block_size = block
        self.slots = slots
        self.cache_len = math.ceil(cache_len / block) * block
        self.prefill_batch = prefill_batch or min(slots, 8)
        self.stop_token_ids = (config.stop_token_ids if config.stop_token_ids is not None
                               else model.stop_token_ids)
        if mesh is not None:
            sharding.check_divisible(cfg, mesh, slots)
        # Each data shard compacts its own slots' rows (decoding.step).
        data_shards = mesh.shape["data"] if mesh is not None else 1
        ladder = bucket_ladder(slots // data_shards * block,
                               config.ladder_for(jax.default_backend()))
        self.settings = decoding.DecodeSettings(
            mode=config.mode, block_size=block, mask_token_id=model.mask_token_id,
            threshold=config.resolved_threshold, alpha=config.alpha,
            unmasking=config.unmasking,
            per_step=decoding.tokens_per_step(block, config.denoising_steps),
            sampler=Sampler(config.temperature, config.top_k, config.top_p),
            processed_ladder=ladder,
            retained_ladder=ladder,
            stop_token_ids=tuple(self.stop_token_ids),
            # The Triton custom calls have no SPMD partitioning rule: on a mesh of several
            # devices the default is the XLA path, which the partitioner shards.
            kernels=config.kernels or ("xla" if mesh is not None and mesh.size > 1 else None),
            mesh=mesh,
        )
        make_state = functools.partial(decoding.init_state, cfg, slots, self.cache_len, block,
                                       self.settings.mask_token_id, config.seed)
        devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
        check_state_fits(jax.eval_shape(make_state), devices, slots, self.cache_len)
        self.state = make_state()
        if mesh is not None:
            # Slots (and the cache) over "data", heads and MLP over "model": each data shard
            # steps its own slots (decoding.step), JAX's SPMD partitioner splits the rest.
            model = dataclasses.replace(model, params=sharding.shard_params(model.params, mesh))
            self.model = model
            self.state = sharding.place(self.state, sharding.state_sharding(self.state, mesh))
        self.stats = RunStats()
        self._queue: collections.deque[_Request] = collections.deque()
        self._slot_request: list[_Request | None] = [None] * slots
        self._results: dict[int, Result] = {}
        self._next_id = 0
        platform = devices[0].platform
        self._prefill = compilation.prefill_program(platform, model.graphdef, self.settings,
                                                    slots, self.cache_len)
        self._round = compilation.decode_round_program(platform, model.graphdef, self.settings,
                                                       config.steps_per_round, slots,
                                                       self.cache_len)

    def lower_round(self) -> jax.stages.Lowered:
        """The decode round, lowered for this engine's model, settings and state (to inspect
        its compiled program: memory, HLO, cost)."""
        return self._round.lower(self.model.params, self.state, np.asarray(False))

    def warmup(self, prompt_lengths: Sequence[int] | None = None) -> None:
        """Compile every program a run can need (the decode round, with all its bucket branches,
        and prefill at every prompt-length bucket, or at the buckets of ``prompt_lengths`` when
        they are known), so that serving never compiles mid-way."""
        if any(r is not None for r in self._slot_request):
            raise RuntimeError("warmup() must run before requests are started")
        buckets = prompt_buckets(self.block_size, self.cache_len)
        if prompt_lengths is not None:
            buckets = sorted({self._prompt_bucket(n) for n in prompt_lengths})
        for length in buckets:
            # Rows aimed at slot index `slots` are padding: compiled and run, nothing written.
            self._run_prefill(np.zeros((self.prefill_batch, length), np.int32),
                              np.ones((self.prefill_batch,), np.int32),
                              np.full((self.prefill_batch,), self.slots, np.int32),
                              np.ones((self.prefill_batch,), np.int32))
        self.state, _, _ = self._round(self.model.params, self.state, np.asarray(False))
        jax.block_until_ready(self.state)

    # ----------------------------------------------------------------------------------- requests
    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a request needs: its prompt and generated blocks, rounded up to B."""
        return math.ceil((prompt_len + max_new_tokens) / self.block_size) * self.block_size

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int | None = None,
               on_tokens: Callable[[int, list[int]], None] | None = None) -> int:
        """Queue a tokenized prompt; returns its request id.

        ``on_tokens(request_id, new_token_ids)`` is called as blocks complete (streaming).
        Raises :class:`RequestError` if the request cannot fit the cache, ``TypeError`` for
        ids that are not integers.
        """
        prompt = token_ids(prompt)
        max_new = max_new_tokens or self.config.max_new_tokens
        if not prompt:
            raise RequestError("empty prompt: give at least one token")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"prompt token ids must lie in [0, {vocab})")
        need = self.positions_needed(len(prompt), max_new)
        if need > self.cache_len:
            raise RequestError(
                f"prompt of {len(prompt)} tokens plus max_new_tokens={max_new} needs {need} cache "
                f"positions, but the cache holds {self.cache_len}: shorten the prompt, lower "
                f"max_new_tokens or raise the cache length")
        rid = self._next_id
        self._next_id += 1
        self._queue.append(_Request(rid, prompt, max_new, on_tokens))
        return rid

    # ------------------------------------------------------------------------------------ running
    def run(self, progress: bool = False) -> dict[int, Result]:
        """Decode until every queued request has finished; returns results by request id."""
        total = sum(r.max_new_tokens for r in self._queue) + sum(
            r.max_new_tokens for r in self._slot_request if r is not None)
        bar = tqdm(total=total, unit="tok", disable=not progress, desc=self.config.mode)
        start = time.perf_counter()
        while self._queue or any(r is not None for r in self._slot_request):
            self._fill_free_slots()
            with self._timed("decode_seconds"):
                self.state, logs, steps = self._round(
                    self.model.params, self.state, np.asarray(bool(self._queue)))
                # One transfer per round: the step logs and slot progress. (On GPUs the call
                # above may already have waited: XLA reads a while loop's condition each step.)
                fetched = to_host((logs, steps, self.state.live, self.state.out_len,
                                   self.state.history, self.state.sequence))
            with self._timed("host_seconds"):
                self._after_round(*fetched, bar)
        self.stats.wall_seconds += time.perf_counter() - start
        bar.close()
        results, self._results = self._results, {}
        return results

    @contextlib.contextmanager
    def _timed(self, field: str) -> Iterator[None]:
        """Adds the block's wall time to ``self.stats.<field>``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self.stats, field, getattr(self.stats, field) + time.perf_counter() - start)

    def _fill_free_slots(self) -> None:
        free = [i for i, r in enumerate(self._slot_request) if r is None]
        batches = []
        with self._timed("host_seconds"):
            # Admit in queue order; prefill the admitted ones shortest first, so that each
            # prefill batch pads to a length close to its members'.
            admitted = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
            admitted.sort(key=lambda r: len(r.prompt))
            for start in range(0, len(admitted), self.prefill_batch):
                batch = admitted[start:start + self.prefill_batch]
                slots = [free.pop(0) for _ in batch]
                batches.append(self._prefill_inputs(batch, slots))
                for request, slot in zip(batch, slots, strict=True):
                    self._slot_request[slot] = request
        if batches:
            with self._timed("prefill_seconds"):
                for inputs in batches:
                    self._run_prefill(*inputs)
                jax.block_until_ready(self.state)

    def _prefill_inputs(self, batch: list[_Request],
                        slots: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = self.prefill_batch
        longest = max(len(r.prompt) for r in batch)
        length = self._prompt_bucket(longest)
        tokens = np.full((n, length), self.settings.mask_token_id, np.int32)
        lengths = np.zeros((n,), np.int32)
        slot_ids = np.full((n,), self.slots, np.int32)  # padding rows: out of range, dropped
        max_new = np.zeros((n,), np.int32)
        for row, (request, slot) in enumerate(zip(batch, slots, strict=True)):
            tokens[row, :len(request.prompt)] = request.prompt
            lengths[row], slot_ids[row], max_new[row] = len(request.prompt), slot, request.max_new_tokens
        return tokens, lengths, slot_ids, max_new

    def _prompt_bucket(self, length: int) -> int:
        return next(size for size in prompt_buckets(self.block_size, self.cache_len)
                    if size >= length)

    def _run_prefill(self, tokens: np.ndarray, lengths: np.ndarray, slot_ids: np.ndarray,
                     max_new: np.ndarray) -> None:
        self.state = self._prefill(self.model.params, self.state, tokens, lengths, slot_ids,
                                   max_new)

    def _after_round(self, logs: decoding.StepLog, steps: np.ndarray, live: np.ndarray,
                     out_len: np.ndarray, history: np.ndarray, sequence: np.ndarray,
                     bar: tqdm) -> None:
        settings = self.settings
        steps = int(steps)
        processed = logs.processed[:steps].sum(-1)  # [steps, slots]
        retained = logs.retained[:steps].sum(-1)
        decoded = logs.decoded[:steps].sum(-1)
        self.stats.rounds += 1
        self.stats.steps += steps
        self.stats.processed_tokens += int(processed.sum())
        self.stats.retained_tokens += int(retained.sum())
        self.stats.decoded_tokens += int(decoded.sum())
        self.stats.sampled_tokens += int(logs.sampled[:steps].sum())
        self.stats.processed_buckets.update(
            settings.processed_ladder[i] for i in logs.processed_bucket[:steps])
        self.stats.retained_buckets.update(
            settings.retained_ladder[i] for i in logs.retained_bucket[:steps])

        for slot, request in enumerate(self._slot_request):
            if request is None:
                continue
            took_part = logs.live[:steps, slot]
            denoising = took_part & (decoded[:, slot] > 0)
            request.stats.steps += int(took_part.sum())
            request.stats.processed_tokens += int(processed[took_part, slot].sum())
            request.stats.retained_tokens += int(retained[took_part, slot].sum())
            request.stats.decoded_per_step += decoded[denoising, slot].tolist()
            request.stats.processed_per_step += processed[denoising, slot].tolist()
            request.stats.retained_per_step += retained[denoising, slot].tolist()
            start = len(request.prompt)
            if live[slot]:
                complete = max(0, int(history[slot]) - start)
                bar.update(complete - request.streamed)
                self._stream(request, sequence[slot, start:start + complete].tolist())
                continue
            ids = sequence[slot, start:start + int(out_len[slot])].tolist()
            bar.update(request.max_new_tokens - request.streamed)
            self._stream(request, ids)
            self._finish(slot, request, ids)

    @staticmethod
    def _stream(request: _Request, ids: list[int]) -> None:
        """Hand the newly completed tokens to the request's callback."""
        if request.on_tokens is not None and len(ids) > request.streamed:
            request.on_tokens(request.rid, ids[request.streamed:])
        request.streamed = max(request.streamed, len(ids))

    def _finish(self, slot: int, request: _Request, ids: list[int]) -> None:
        tokenizer = self.model.tokenizer
        self._results[request.rid] = Result(
            token_ids=ids,
            text=tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else None,
            # A stop token ends the output before max_new_tokens; otherwise the cap did.
            finish_reason="stop" if len(ids) < request.max_new_tokens else "length",
            prompt_tokens=len(request.prompt),
            stats=request.stats,
        )
        self.stats.generated_tokens += len(ids)
        self._slot_request[slot] = None


def check_state_fits(state: decoding.DecodeState, devices: Sequence[jax.Device], slots: int,
                     positions: int) -> None:
    """Raise ``ConfigError`` if the decode state (``state``: shapes, e.g. from ``eval_shape``;
    nearly all of it the KV cache) cannot fit in the devices' free memory, spread evenly over
    them. Devices that do not report their memory (CPUs) are not checked."""
    # Only this process's devices can report (the others are checked by their own processes).
    stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
    if not stats or any(not s or "bytes_limit" not in s for s in stats):
        return
    needed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / len(devices)
    free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    if needed > free:
        gib = 2**30
        raise ConfigError(
            f"the decode state ({slots} slots x {positions} cache positions, nearly all of it the "
            f"KV cache) needs {needed / gib:.1f} GiB per device, but {free / gib:.1f} GiB are "
            f"free: use fewer slots (batch size) or a shorter cache (shorter prompts or fewer "
            f"max_new_tokens)")
