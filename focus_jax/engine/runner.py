"""The runner: the device side of the engine. It owns the decode state and the compiled
programs (prefill into slots, release of slots, the decode round) and nothing else."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from focus_jax import compilation, decoding, interrupts, sharding
from focus_jax.cache import PagedCache
from focus_jax.config import ConfigError, GenerationConfig
from focus_jax.distributed import to_host
from focus_jax.engine.params import slot_params_rows
from focus_jax.engine.scheduler import Request
from focus_jax.model import Model


def slot_positions(block_size: int, cache_len: int) -> int:
    """Cache positions per slot the engine allocates when asked for ``cache_len``: whole
    blocks."""
    return math.ceil(cache_len / block_size) * block_size


def default_prefill_batch(slots: int, platform: str = "gpu") -> int:
    """Prompts per prefill call when the engine is not given its own number: ``min(slots, 8)``
    on accelerators, 1 on CPUs (where a batch of prompts costs what they cost one by one, and
    half the prefill programs are then never compiled)."""
    return 1 if platform == "cpu" else min(slots, 8)


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


PREFILL_CHUNK = 1024
"""Prompt tokens a prefill runs at once, at most (rounded down to the block size times a power
of two): a longer prompt is prefilled alone, a chunk at a time, each chunk attending to the
chunks before it in the cache. Prefill attention holds its scores whole (rows x heads x chunk x
context), so an unbounded prompt's would not fit: 8 prompts of 6,144 tokens at SDAR-8B asked for
36 GiB."""


def default_prefill_chunk(block_size: int) -> int:
    """The largest ``block_size * 2^k`` not above :data:`PREFILL_CHUNK` (one block at least)."""
    chunk = block_size
    while chunk * 2 <= PREFILL_CHUNK:
        chunk *= 2
    return chunk


def check_prefill_chunk(block_size: int, chunk: int) -> None:
    """Raise ``ConfigError`` unless ``chunk`` is the block size times a power of two (a prompt
    bucket: a chunk's rest is then prefilled at a bucket no longer than the chunk)."""
    if not (chunk >= block_size and chunk % block_size == 0
            and (chunk // block_size) & (chunk // block_size - 1) == 0):
        raise ConfigError(f"prefill_chunk must be the block size ({block_size}) times a power "
                          f"of two, got {chunk}")


def chunk_rest(length: int, chunk: int) -> int:
    """Tokens of the last chunk of a prompt of ``length`` tokens prefilled in chunks of
    ``chunk``."""
    return length - (length - 1) // chunk * chunk


def prefill_buckets(block_size: int, cache_len: int, prompt_lengths: Sequence[int] | None,
                    chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prompt buckets a prompt is prefilled whole at (those up to ``chunk``: every such
    bucket of ``cache_len``, or those of ``prompt_lengths`` when they are known), and the
    ``computed`` buckets of the chunks of longer prompts (one row each; none if no prompt can be
    longer than ``chunk``)."""
    bucket = functools.partial(prompt_bucket, block_size, cache_len)
    if prompt_lengths is None:
        whole = tuple(size for size in prompt_buckets(block_size, cache_len) if size <= chunk)
        return whole, (whole if cache_len > chunk else ())
    whole = tuple(sorted({bucket(n) for n in prompt_lengths if n <= chunk}))
    long = [n for n in prompt_lengths if n > chunk]
    return whole, tuple(sorted({chunk} | {bucket(chunk_rest(n, chunk)) for n in long}
                               if long else ()))


def warmup_inputs(block_size: int, slots: int, cache_len: int, prefill_batch: int,
                  prompt_lengths: Sequence[int] | None, prefix: bool, chunk: int
                  ) -> tuple[list[tuple], list[tuple[tuple, dict]]]:
    """A warm-up's padding inputs (:meth:`Runner.warmup`): the whole prefills' (for each of
    :func:`prefill_rows` and whole bucket of :func:`prefill_buckets`), and the prefills' after a
    cached prefix (with their static ``computed``): one row at each chunk bucket, and with
    ``prefix`` (prefix caching) each of the rows at every bucket up to the longest."""
    buckets, chunks = prefill_buckets(block_size, cache_len, prompt_lengths, chunk)
    # Rows aimed at slot index `slots` are padding: compiled and run, nothing written.
    rows = prefill_rows(prefill_batch)
    padding = [(np.zeros((n, length), np.int32), np.ones((n,), np.int32),
                np.full((n,), slots, np.int32), slot_params_rows([], n))
               for n, length in itertools.product(rows, buckets)]
    after = {(1, rest) for rest in chunks}
    if prefix and buckets + chunks:
        after |= set(itertools.product(rows, prompt_buckets(block_size,
                                                            max(buckets + chunks))))
    after_prefix = [
        ((np.zeros((n, cache_len + rest), np.int32), np.ones((n,), np.int32),
          np.zeros((n,), np.int32), np.full((n,), slots, np.int32),
          slot_params_rows([], n)), {"computed": rest})
        for n, rest in sorted(after)]
    return padding, after_prefix


def prompt_bucket(block_size: int, cache_len: int, length: int) -> int:
    """The padded length a prompt of ``length`` tokens is prefilled at (:func:`prompt_buckets`)."""
    return next(size for size in prompt_buckets(block_size, cache_len) if size >= length)


def prefill_rows(prefill_batch: int) -> tuple[int, ...]:
    """The row counts of the prefill programs: one request alone, or a full prefill batch
    (:meth:`Runner.prefill`)."""
    return tuple(sorted({1, prefill_batch}))


class Runner:
    """The decode state of ``slots`` slots of ``cache_len`` positions, and the programs that
    change it. The state is allocated already sharded over ``mesh`` (slots and cache over
    ``data``, KV heads over ``model``). ``pages``: a paged KV cache of that many pages (the
    host hands slots their pages: :meth:`assign_pages`); ``None``: the contiguous cache."""

    def __init__(self, model: Model, settings: decoding.DecodeSettings, *, slots: int,
                 cache_len: int, prefill_batch: int, steps_per_round: int,
                 mesh: Mesh | None = None, pages: int | None = None,
                 prefill_chunk: int | None = None):
        self.settings, self.slots, self.cache_len = settings, slots, cache_len
        self.prefill_batch, self.steps_per_round = prefill_batch, steps_per_round
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(settings.block_size)
        check_prefill_chunk(settings.block_size, self.prefill_chunk)
        self.pages = pages
        self.abstract = is_abstract(model.params)
        """Whether the weights are shapes only (``bench --compile-only``): the state is then
        shapes too, and the runner can compile its programs but run nothing."""
        if self.abstract and mesh is not None:
            raise ConfigError("a model of weight shapes only compiles for one device, not a mesh")
        self.model, self.state = placed_state(model, settings, slots, cache_len, pages, mesh,
                                              self.abstract)
        platform = (mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]).platform
        graphdef = model.graphdef
        self._prefill = compilation.prefill_program(platform, graphdef, settings, slots,
                                                    cache_len, pages)
        self._round = compilation.decode_round_program(platform, graphdef, settings,
                                                       steps_per_round, slots, cache_len, pages)
        self._prefix_prefill = compilation.prefix_prefill_program(
            platform, graphdef, settings, slots, cache_len, pages)
        self._release = compilation.release_program
        self.interrupt = interrupts.Interrupt()
        """Ends a running round after its current step when set (read by interruptible rounds
        only: ``settings.interruptible``)."""

    def prompt_bucket(self, length: int) -> int:
        """The padded length a prompt of ``length`` tokens is prefilled at."""
        return prompt_bucket(self.settings.block_size, self.cache_len, length)

    def prefill(self, batch: Sequence[Request]) -> None:
        """Start the requests of ``batch`` (at most ``prefill_batch``) in their slots. One whose
        uncached prompt is longer than ``prefill_chunk`` goes alone, a chunk at a time. Up to
        half a prefill batch goes one request at a time: a padded batch computes its padding
        rows too, so one request admitted into a busy engine would cost a whole batch's
        prefill."""
        def chunked(request: Request) -> bool:
            return len(request.prompt) - self._cached(request) > self.prefill_chunk

        for request in filter(chunked, batch):
            self._prefill_chunks(request)
        batch = [r for r in batch if not chunked(r)]
        if len(batch) * 2 <= self.prefill_batch:
            for request in batch:
                self._prefill_rows([request], 1)
        elif batch:
            self._prefill_rows(batch, self.prefill_batch)

    def _cached(self, request: Request) -> int:
        """Leading prompt positions whose KV the request's slot already holds."""
        return request.cached_blocks * self.settings.block_size

    def _prefill_chunks(self, request: Request) -> None:
        """Prefill one request's uncached prompt in chunks of ``prefill_chunk`` tokens, each a
        prefill after a cached prefix (the chunks before it). Every call sets the slot's state
        as the whole prefill would; the last one writes the tail block."""
        n, start = len(request.prompt), self._cached(request)
        while n - start > self.prefill_chunk:
            self._prefill_rows([request], 1, start, self.prefill_chunk)
            start += self.prefill_chunk
        self._prefill_rows([request], 1, start, self.prompt_bucket(n - start))

    def _prefill_rows(self, batch: Sequence[Request], n: int, start: int | None = None,
                      computed: int | None = None) -> None:
        """Prefill ``batch`` as ``n`` rows. Where a request shares cached prompt blocks
        (``Request.cached_blocks``) only the positions after them are run: each row from its
        own start, over the bucket of the longest such rest, reading its slot's cached
        positions (the whole cache width: one program per rows and rest bucket, compiled by the
        warm-up). ``start`` and ``computed``: one request's chunk, its positions ``[start,
        start + computed)`` run after the cache's (:meth:`_prefill_chunks`)."""
        starts = [self._cached(r) if start is None else start for r in batch]
        after_prefix = computed is not None or any(starts)
        if after_prefix:
            computed = computed or self.prompt_bucket(
                max(len(r.prompt) - s for r, s in zip(batch, starts, strict=True)))
            width = self.cache_len + computed
        else:
            width = self.prompt_bucket(max(len(r.prompt) for r in batch))
        tokens = np.full((n, width), self.settings.mask_token_id, np.int32)
        lengths, start_ids = np.ones((n,), np.int32), np.zeros((n,), np.int32)
        slot_ids = np.full((n,), self.slots, np.int32)  # padding rows: out of range, dropped
        for row, request in enumerate(batch):
            tokens[row, :len(request.prompt)] = request.prompt
            lengths[row], slot_ids[row] = len(request.prompt), request.slot
            start_ids[row] = starts[row]
        params = slot_params_rows([r.params for r in batch], n)
        if after_prefix:
            self.state = self._prefix_prefill(self.model.params, self.state, tokens, lengths,
                                              start_ids, slot_ids, params, computed=computed)
        else:
            self._run_prefill(tokens, lengths, slot_ids, params)

    def _run_prefill(self, tokens: np.ndarray, lengths: np.ndarray, slot_ids: np.ndarray,
                     params: decoding.SlotParams) -> None:
        self.state = self._prefill(self.model.params, self.state, tokens, lengths, slot_ids, params)

    def release(self, slots: Sequence[int]) -> None:
        """Stop the requests in ``slots`` (aborted) before the next round."""
        padded = np.full((self.slots,), self.slots, np.int32)
        padded[:len(slots)] = slots
        self.state = self._release(self.state, padded)

    def assign_pages(self, requests: Sequence[Request]) -> None:
        """Write the page-table rows of the requests' slots (a paged cache): each request's
        pages in position order (``Request.pages``)."""
        width = self.cache_len // self.settings.block_size
        slot_ids = np.full((self.slots,), self.slots, np.int32)  # padding rows: dropped
        table = np.full((self.slots, width), self.pages, np.int32)
        for row, request in enumerate(requests):
            slot_ids[row] = request.slot
            table[row, :len(request.pages)] = request.pages
        self.state = compilation.set_pages_program(self.state, slot_ids, table)

    def decode_round(self, stop_on_finish: bool, steps: int | None = None,
                     stop_on_first_output: bool = False) -> decoding.RoundResults:
        """Run a round of at most ``steps`` steps (default and cap: ``steps_per_round``; until
        every slot is idle, or the first finished request with ``stop_on_finish``, or the first
        request's first output with ``stop_on_first_output``) and copy its results to the
        host."""
        self.state, results, _ = self._round(
            *self._round_args(stop_on_finish, steps, stop_on_first_output))
        # One transfer per round: the step counts and slot progress, packed in one array.
        return decoding.unpack_round(to_host(results), self.steps_per_round)

    def _round_args(self, stop_on_finish: bool, steps: int | None = None,
                    stop_on_first_output: bool = False) -> tuple:
        """The decode round's arguments (the step limit and the stop switches are run-time
        values: one program)."""
        limit = self.steps_per_round if steps is None else steps
        return (self.model.params, self.state, np.asarray(stop_on_finish), np.int32(limit),
                np.asarray(stop_on_first_output), np.int32(self.interrupt.channel))

    def lower_round(self) -> jax.stages.Lowered:
        """The decode round, lowered for this runner's model, settings and state (to inspect its
        compiled program: memory, HLO, cost)."""
        return self._round.lower(*self._round_args(False))

    def warmup(self, prompt_lengths: Sequence[int] | None = None, run: bool = True,
               prefix: bool = False) -> None:
        """Compile every program a run can need: the decode round (with all its bucket branches),
        release, and prefill for each of :func:`prefill_rows` at every prompt-length bucket up
        to ``prefill_chunk`` (or at the buckets of ``prompt_lengths`` when they are known), and
        the prefill after a cached prefix for the chunks of longer prompts; with ``prefix``
        (prefix caching) for each rows and every bucket up to those (:func:`warmup_inputs`).
        Runs them on padding only: nothing changes. ``run=False``: compile the round and
        the prefills ahead of time and run nothing (no temporaries allocated: filling a
        compilation cache).

        Every round runs this one decode round: a program with another bucket ladder (a faster
        compile, say) multiplies other row counts, which in bfloat16 can flip a near-tie token,
        so switching programs mid-request would make a request's tokens depend on when a
        compile finished (docs/startup.md, "One program per engine")."""
        if run and self.abstract:
            raise ConfigError("a model of weight shapes only can compile (run=False), not run")
        padding, after_prefix = self._warmup_inputs(prompt_lengths, prefix)
        if compilation.WARMUP_WORKERS > 1 or not run:  # side by side first, the round the longest
            compilation.compile_together(self._programs(padding, after_prefix))
        if not run:
            return
        with out_of_memory_as_config_error(self.slots, self.cache_len):
            for args in padding:
                self._run_prefill(*args)
            for args, static in after_prefix:
                self.state = self._prefix_prefill(self.model.params, self.state, *args, **static)
            self.release([])
            if self.pages is not None:
                self.assign_pages([])
            self.state, _, _ = self._round(*self._round_args(False))
            jax.block_until_ready(self.state)

    def programs(self, prompt_lengths: Sequence[int] | None = None, prefix: bool = False
                 ) -> list[tuple]:
        """What :meth:`warmup` compiles, as :func:`compilation.compile_together` takes it:
        ``(program, args, static)`` for the round (first: the longest compile) and each
        prefill."""
        return self._programs(*self._warmup_inputs(prompt_lengths, prefix))

    def _warmup_inputs(self, prompt_lengths: Sequence[int] | None, prefix: bool) -> tuple:
        return warmup_inputs(self.settings.block_size, self.slots, self.cache_len,
                             self.prefill_batch, prompt_lengths, prefix, self.prefill_chunk)

    def _programs(self, padding: list[tuple], after_prefix: list[tuple[tuple, dict]]
                  ) -> list[tuple]:
        return ([(self._round, self._round_args(False), {})]
                + [(self._prefill, (self.model.params, self.state, *args), {})
                   for args in padding]
                + [(self._prefix_prefill, (self.model.params, self.state, *args), static)
                   for args, static in after_prefix])


def placed_state(model: Model, settings: decoding.DecodeSettings, slots: int, cache_len: int,
                 pages: int | None, mesh: Mesh | None, abstract: bool
                 ) -> tuple[Model, decoding.DecodeState]:
    """The model as the runner holds it (sharded over ``mesh``) and its decode state, allocated
    already placed (shapes only when the weights are ``abstract``); checks that weights and
    state fit the devices first."""
    cfg = model.config
    make_state = functools.partial(decoding.init_state, cfg, slots, cache_len,
                                   settings.block_size, settings.mask_token_id, pages)
    shapes = jax.eval_shape(make_state)
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    if not abstract:  # shapes hold nothing: the engine that runs them checks
        check_memory_fits(model.params, shapes, devices, mesh, slots, cache_len)
    if mesh is not None:
        # Slots (and the cache) over "data", heads and MLP over "model": each data shard
        # steps its own slots (decoding.step), JAX's SPMD partitioner splits the rest.
        model = dataclasses.replace(model, params=sharding.shard_params(model.params, mesh))
        placed = sharding.state_sharding(shapes, mesh)
    else:
        placed = SingleDeviceSharding(devices[0])
    init = compilation.PROGRAMS.get(
        ("state", cfg, slots, cache_len, settings.block_size, settings.mask_token_id, pages,
         placed),
        lambda: jax.jit(make_state, out_shardings=placed))
    return model, init.eval_shape() if abstract else init()


def is_abstract(params: nnx.State) -> bool:
    """Whether ``params`` are weight shapes (``jax.ShapeDtypeStruct``) rather than arrays: a
    model to compile for without holding its weights (``bench.random_model(abstract=True)``)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))


KV_MEMORY_FRACTION = 0.85
"""The share of the device memory left after the weights that a paged cache's pool takes when
it is not sized explicitly: the rest holds the programs' temporaries."""


def pool_pages(model: Model, config: GenerationConfig, block_size: int, slots: int,
               cache_len: int, devices: Sequence[jax.Device], mesh: Mesh | None) -> int:
    """Pages in a paged cache's pool: ``config.kv_pages``; else as many as
    ``config.kv_cache_memory`` bytes per device hold; else ``KV_MEMORY_FRACTION`` of the memory
    left after the weights on the fullest device; on devices that do not report their memory
    (CPUs), as many as a contiguous cache of ``slots`` x ``cache_len`` positions. A mesh's
    ``data`` shards each hold their own part of the pool: the count is a multiple of them."""
    shards = mesh.shape["data"] if mesh is not None else 1
    if config.kv_pages is not None:
        if config.kv_pages % shards:
            raise ConfigError(f"kv_pages={config.kv_pages} does not split evenly over the mesh's "
                              f"{shards} data shards (each holds its own pages): give a multiple "
                              f"of {shards}")
        return config.kv_pages
    page_bytes = PagedCache.page_bytes(model.config, block_size,
                                       mesh.shape["model"] if mesh is not None else 1)
    memory = config.kv_cache_memory
    if memory is None:
        free = free_bytes(model.params, devices)
        if free is None:
            return slots * (cache_len // block_size)
        weights = sharding.bytes_per_device(
            model.params, None if mesh is None else sharding.param_shardings(model.params, mesh))
        memory = int(KV_MEMORY_FRACTION * (free - weights))
    pages = memory // page_bytes
    if pages < 1:
        raise ConfigError(f"the KV cache's memory ({_size(memory)} per device) holds no page of "
                          f"{_size(page_bytes)}: give it more (kv_cache_memory)")
    return pages * shards


def check_memory_fits(params: nnx.State, state: decoding.DecodeState,
                      devices: Sequence[jax.Device], mesh: Mesh | None, slots: int,
                      positions: int) -> None:
    """Raise ``ConfigError`` if the weights ``params`` and the decode state ``state`` (shapes,
    e.g. from ``eval_shape``; nearly all of it the KV cache), placed as the engine places them
    (sharded over ``mesh``, or on ``devices[0]``), do not fit the devices' memory. Weights
    already on a device count as free there: they are moved, not added. Devices that do not
    report their memory (CPUs) are not checked."""
    free = free_bytes(params, devices)
    if free is None:
        return
    needed = sharding.resident_bytes(params, state, mesh)
    if needed.total > free:
        raise ConfigError(
            f"the weights ({_size(needed.weights)} per device) and the decode state ({slots} "
            f"slot{'s' if slots > 1 else ''} x {positions} cache positions: "
            f"{_size(needed.decode_state)} per device) need "
            f"{_size(needed.total)} per device, but {_size(free)} are free: use fewer slots "
            f"(batch size), a shorter cache (shorter prompts or fewer max_new_tokens) or more "
            f"devices")


@contextlib.contextmanager
def out_of_memory_as_config_error(slots: int, positions: int) -> Iterator[None]:
    """Running a program allocates its temporaries (the round's logits and activations, which
    :func:`check_memory_fits` does not count): a device that cannot hold them is a one-line
    error naming the shape (``slots`` x ``positions``), not XLA's traceback."""
    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        reason = str(err).split("[")[0].strip().removeprefix("RESOURCE_EXHAUSTED: ")
        # The failed program's runtime token holds the error, and JAX's exit hooks wait on every
        # token: they would print it twice more as tracebacks after this one line (seen on an
        # H100). It is reported here, so the tokens are dropped (JAX 0.11.2's token set).
        from jax._src import dispatch

        dispatch.runtime_tokens.clear()
        raise ConfigError(
            f"the device ran out of memory warming up {slots} slots x {positions} cache "
            f"positions ({reason.rstrip('.')}): use fewer slots (batch size), a shorter cache "
            f"(max_model_len) or more devices") from None


def free_bytes(params: nnx.State, devices: Sequence[jax.Device]) -> int | None:
    """The least memory free on any of this process's ``devices``, counting the weights
    ``params`` already on a device as free there (they are moved, not added); None where a
    device does not report its memory (CPUs). Only this process's devices can report: the
    others are checked by their own processes."""
    own = [d for d in devices if d.process_index == jax.process_index()]
    stats = [d.memory_stats() for d in own]
    if not stats or any(not s or "bytes_limit" not in s for s in stats):
        return None
    return min(s["bytes_limit"] - s.get("bytes_in_use", 0) + sharding.bytes_on(params, d)
               for d, s in zip(own, stats, strict=True))


def _size(n: int) -> str:
    """Bytes in the largest of GiB, MiB and KiB that keeps them >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"
