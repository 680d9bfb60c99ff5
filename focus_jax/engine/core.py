"""The engine: a request lifecycle over ``S`` slots, continuous batching at block boundaries.

``add_request`` queues a request, ``abort`` ends one, and each ``step()`` is one round: aborted
requests release their slots, waiting requests are admitted into free slots and prefilled
(:class:`~focus_jax.engine.scheduler.Scheduler`), the compiled decode round runs a bounded
number of steps on the device (:class:`~focus_jax.engine.runner.Runner`: a ``lax.while_loop``,
no host round trip per step), and the outputs of the blocks it committed come back
(:class:`~focus_jax.engine.output.OutputProcessor`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from focus_jax import decoding, sharding
from focus_jax.cache.pages import ShardedPool
from focus_jax.compaction import bucket_ladder
from focus_jax.config import ConfigError, GenerationConfig, ModelConfig
from focus_jax.engine.output import OutputProcessor, RequestOutput, Result, RunStats
from focus_jax.engine.params import RequestError, SamplingParams
from focus_jax.engine.runner import Runner, default_prefill_batch, pool_pages, slot_positions
from focus_jax.engine.scheduler import Request, Scheduler
from focus_jax.interrupts import Interrupt
from focus_jax.model import Model
from focus_jax.policies import Policies
from focus_jax.prompts import token_ids
from pallas_kernels.dispatch import unusable

log = logging.getLogger(__name__)


class Engine:
    """Continuous-batching block-diffusion decoder over ``slots`` concurrent requests.

    >>> engine = Engine(model, GenerationConfig(mode="focus"), slots=8, cache_len=1024)
    >>> rid = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=128, temperature=0.7))
    >>> while engine.has_unfinished():
    ...     for out in engine.step():
    ...         print(out.request_id, out.new_text, out.finish_reason)

    ``config`` fixes what changes the compiled programs (mode, block size, unmasking rule,
    bucket ladder, kernels, steps per round) and gives the defaults of every request's
    :class:`SamplingParams`. ``slots`` and ``cache_len`` (positions per slot) default to
    ``config.max_batch`` and ``config.max_cache_len``, else to the platform's
    (:func:`default_shape`: 4 x 256 on a CPU, 64 x 2048 on GPUs and TPUs). One thread drives
    an engine (:class:`AsyncEngine` runs it on a background thread for servers).
    ``prefill_chunk``: prompt tokens one prefill runs at most, a longer prompt going alone in
    chunks (default: :func:`~focus_jax.engine.runner.default_prefill_chunk`, 1,024 tokens).
    """

    def __init__(self, model: Model, config: GenerationConfig, *, slots: int | None = None,
                 cache_len: int | None = None, prefill_batch: int | None = None,
                 mesh: Mesh | None = None, detokenize: bool = True,
                 prefill_chunk: int | None = None):
        cfg = model.config
        devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
        slots, cache_len, block = _shape(cfg, config, slots, cache_len, devices[0].platform)
        self.config = config
        self.block_size = block
        self.slots = slots
        self.cache_len = slot_positions(block, cache_len)
        self.stop_token_ids = tuple(config.stop_token_ids if config.stop_token_ids is not None
                                    else model.stop_token_ids)
        if mesh is not None:
            sharding.check_divisible(cfg, mesh, slots)
        self.settings = decode_settings(config.replace(block_size=block), model.mask_token_id,
                                        slots, devices[0].platform, mesh)
        self.runner = _runner(model, config, self.settings, slots, self.cache_len, mesh,
                              prefill_batch, prefill_chunk)
        self.model, pages = self.runner.model, self.runner.pages
        self.scheduler = Scheduler(slots, self.cache_len, block,
                                   pool=None if pages is None else ShardedPool.split(
                                       pages, mesh.shape["data"] if mesh is not None else 1),
                                   prefix_caching=config.prefix_caching)
        self.output = OutputProcessor(model.tokenizer if detokenize else None)
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []
        """Outputs decided outside a step (aborts of waiting requests), returned by the next."""

    @property
    def stats(self) -> RunStats:
        """Statistics of everything this engine ran."""
        return self.output.stats

    @property
    def state(self) -> decoding.DecodeState:
        """The decode state on the device (owned by the runner)."""
        return self.runner.state

    @property
    def round_interrupt(self) -> Interrupt:
        """The flag that ends a running round after its current step (thread-safe; its owner
        clears it before taking new requests in). Rounds read it only with
        ``interruptible_rounds``; otherwise setting it changes nothing."""
        return self.runner.interrupt

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        """Requests wait or run, or outputs are still to be returned by :meth:`step`."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    # ----------------------------------------------------------------------------------- requests
    def validate(self, prompt: Sequence[int],
                 params: SamplingParams | None = None) -> tuple[list[int], SamplingParams]:
        """The prompt as a list of token ids and the request's resolved parameters; raises
        :class:`RequestError` for a request this engine cannot serve (``TypeError`` for ids that
        are not integers). Reads only the engine's configuration (safe from any thread)."""
        ids = _token_ids(prompt, self.model.config.vocab_size)
        resolved = (params or SamplingParams()).resolved(self.config, self.stop_token_ids)
        self.scheduler.check_fits(len(ids), resolved.max_new_tokens)
        return ids, resolved

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
                    request_id: int | None = None, arrival_time: float | None = None) -> int:
        """Queue a tokenized prompt; returns its request id. It is admitted at the next
        :meth:`step` with a free slot. Raises :class:`RequestError` if it cannot be served.
        ``arrival_time``: its ``time.perf_counter()`` arrival, if earlier than now (benchmarks)."""
        ids, resolved = self.validate(prompt, params)
        rid = next(self._ids) if request_id is None else request_id
        self.scheduler.add(Request(rid, ids, resolved), arrival_time)
        return rid

    def abort(self, request_id: int) -> None:
        """End a request: a waiting one at once, a running one at the next step (its slot is
        then free). Its last output has ``finish_reason="abort"``. Unknown ids are ignored."""
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._pending.append(self._final(request, "abort"))

    # ------------------------------------------------------------------------------------ running
    def warmup(self, prompt_lengths: Sequence[int] | None = None, run: bool = True) -> None:
        """Compile every program a run can need (see :meth:`Runner.warmup`; ``run=False``: only
        compile), so that serving never compiles mid-way. Must run before requests are started."""
        if self.scheduler.running:
            raise RuntimeError("warmup() must run before requests are started")
        self.runner.warmup(prompt_lengths, run, prefix=self.config.prefix_caching)

    def step(self) -> list[RequestOutput]:
        """One round: release aborted slots, admit and prefill waiting requests, run the decode
        round, and return the outputs of the blocks it committed and of the requests it ended."""
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        outputs += self._release_aborted()
        outputs += self._admit()
        if self.scheduler.running:
            with self.stats.timed("decode_seconds"):
                short = self._short_rounds()
                results = self.runner.decode_round(
                    stop_on_finish=bool(self.scheduler.waiting),
                    steps=self.config.free_slot_round_steps if short else None,
                    stop_on_first_output=short)
            with self.stats.timed("host_seconds"):
                outputs += self._after_round(results)
        self.stats.wall_seconds += time.perf_counter() - start
        return outputs

    def _release_aborted(self) -> list[RequestOutput]:
        """Free the slots of the requests aborted since the last round; their last outputs."""
        with self.stats.timed("host_seconds"):
            aborted = self.scheduler.take_aborted()
            outputs = [self._final(r, "abort") for r in aborted]
        if aborted:
            self.runner.release([r.slot for r in aborted])
            for request in aborted:
                self.scheduler.finish(request)
        return outputs

    def _admit(self) -> list[RequestOutput]:
        """Admit waiting requests into free slots (a paged cache: give the running ones the
        pages the coming round can reach) and prefill them; the outputs of those refused."""
        with self.stats.timed("host_seconds"):
            admitted, refused = self.scheduler.admit()
            outputs = [self._final(r, "error", str(err)) for r, err in refused]
        if self.scheduler.pool is not None:
            with self.stats.timed("host_seconds"):
                grown = self.scheduler.extend_pages(self.config.steps_per_round)
                changed = {r.slot: r for r in [*admitted, *grown]}
            if changed:
                self.runner.assign_pages(list(changed.values()))
            self.stats.kv_pages = self.scheduler.pool.total
            self.stats.kv_pages_peak = max(self.stats.kv_pages_peak, self.scheduler.pool.held)
        if admitted:
            with self.stats.timed("prefill_seconds"):
                for batch in self.scheduler.batches(admitted, self.runner.prefill_batch):
                    self.runner.prefill(batch)
                jax.block_until_ready(self.runner.state)
            now = time.perf_counter()
            for request in admitted:
                request.stats.admitted_time = now
                self.scheduler.register_prompt(request)
                self.output.record_prefill(request, self.block_size)
        return outputs

    def _short_rounds(self) -> bool:
        """Short rounds while a slot is free and nothing waits: an arrival is admitted soon, and
        a round ends as soon as a request has its first output, which is streamed at once.
        Whole rounds otherwise (the round caps ``free_slot_round_steps`` at
        ``steps_per_round``)."""
        return not self.scheduler.waiting and len(self.scheduler.running) < self.slots

    def _after_round(self, results: decoding.RoundResults) -> list[RequestOutput]:
        running = dict(self.scheduler.running)
        self.output.record_round(results, running)
        outputs = []
        for slot, request in running.items():
            try:
                out = _slot_output(self.output, self.scheduler, request, slot, results)
            except Exception as err:  # one request's handling fails: it ends, the others go on
                if results.live[slot]:
                    self.runner.release([slot])
                self.scheduler.finish(request)
                out = self._final(request, "error", f"{type(err).__name__}: {err}")
            if out is not None:
                outputs.append(out)
        return outputs

    def _final(self, request: Request, reason: str, error: str | None = None) -> RequestOutput:
        return self.output.output(request, request.returned, reason, error)

    def lower_round(self) -> jax.stages.Lowered:
        """The decode round, lowered for this engine's model, settings and state."""
        return self.runner.lower_round()


def compile_ahead(engine: Engine) -> threading.Thread:
    """Start compiling ``engine``'s programs (``warmup(run=False)``) on a background thread and
    return the thread. For an engine of a model of weight shapes
    (:func:`focus_jax.checkpoint.describe`): it compiles while the weights load, and the loaded
    model's engine of the same settings then finds its programs compiled. A failure is left to
    that engine's warm-up, which meets it again (logged here at debug level)."""
    def work() -> None:
        try:
            engine.warmup(run=False)
        except Exception:
            log.debug("compiling ahead failed; the warm-up compiles again", exc_info=True)

    thread = threading.Thread(target=work, name="focus_jax_compile_ahead", daemon=True)
    thread.start()
    return thread


def _slot_output(output: OutputProcessor, scheduler: Scheduler, request: Request, slot: int,
                 results: decoding.RoundResults) -> RequestOutput | None:
    """What a round gave the request in ``slot``: its complete blocks so far, or its end (its
    slot then freed)."""
    start = len(request.prompt)
    if results.live[slot]:
        request.history = int(results.history[slot])
        return output.output(request, results.tokens(slot, request.returned, start,
                                                      max(start, request.history)))
    ids = results.tokens(slot, request.returned, start, start + int(results.out_len[slot]))
    # A stop token ends the output before max_new_tokens; otherwise the cap did.
    reason = "stop" if len(ids) < request.max_new_tokens else "length"
    scheduler.finish(request)
    return output.output(request, ids, reason)


CPU_SHAPE = (4, 256)
"""Slots and cache positions per slot of an engine on a CPU when none are given: it compiles and
answers in seconds (64 x 2048 took 3.9 GB and 55 s to warm up with the bundled model)."""
ACCELERATOR_SHAPE = (64, 2048)
"""The same on GPUs and TPUs."""


def default_shape(platform: str, max_positions: int) -> tuple[int, int]:
    """Slots and cache positions per slot when an engine is given neither (nor
    ``GenerationConfig.max_batch`` / ``max_cache_len``): :data:`CPU_SHAPE` on CPUs,
    :data:`ACCELERATOR_SHAPE` elsewhere, at most the model's ``max_positions``."""
    slots, positions = CPU_SHAPE if platform == "cpu" else ACCELERATOR_SHAPE
    return slots, min(positions, max_positions)


def decode_settings(config: GenerationConfig, mask_token_id: int, slots: int, platform: str,
                    mesh: Mesh | None = None) -> decoding.DecodeSettings:
    """The static settings of the decode programs for ``config`` (its block size set) on
    ``slots`` slots of ``platform`` devices: the policies of its mode, the bucket ladders of the
    processed and the retained rows (the platform's defaults unless ``config`` names one ladder
    for both), the kernels."""
    block = config.block_size
    if config.kernels is not None and (why := unusable(config.kernels, platform)):
        raise ConfigError(why)
    if config.interruptible_rounds and jax.process_count() > 1:
        raise ConfigError("interruptible_rounds needs a single process: the processes of a "
                          "multi-process run must end every round at the same step")
    # Each data shard compacts its own slots' rows (decoding.step).
    data_shards = mesh.shape["data"] if mesh is not None else 1
    full, smallest = slots // data_shards * block, config.min_bucket_for(platform)
    retained = bucket_ladder(full, config.ladder_for(platform), minimum=smallest)
    processed = bucket_ladder(full, config.processed_ladder_for(platform), minimum=smallest)
    # On a mesh the step calls each kernel through its sharded entry point.
    policies = Policies.for_mode(config.mode, config.unmasking,
                                 decoding.tokens_per_step(block, config.denoising_steps),
                                 config.kernels, mesh)
    return decoding.DecodeSettings(block_size=block, mask_token_id=mask_token_id,
                                   policies=policies, processed_ladder=processed,
                                   retained_ladder=retained, kernels=config.kernels, mesh=mesh,
                                   interruptible=config.interruptible_rounds)


def _runner(model: Model, config: GenerationConfig, settings: decoding.DecodeSettings,
            slots: int, cache_len: int, mesh: Mesh | None, prefill_batch: int | None,
            prefill_chunk: int | None) -> Runner:
    """An engine's runner: its KV cache's pool sized (paged) and its prefill batch defaulted for
    the devices' platform."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    pages = (pool_pages(model, config, settings.block_size, slots, cache_len, devices, mesh)
             if config.kv_cache == "paged" else None)
    return Runner(model, settings, slots=slots, cache_len=cache_len,
                  prefill_batch=prefill_batch or default_prefill_batch(slots,
                                                                       devices[0].platform),
                  steps_per_round=config.steps_per_round, mesh=mesh, pages=pages,
                  prefill_chunk=prefill_chunk)


def _shape(cfg: ModelConfig, config: GenerationConfig, slots: int | None,
           cache_len: int | None, platform: str) -> tuple[int, int, int]:
    """An engine's slots, positions per slot (before rounding to whole blocks) and block size:
    the ones given, else ``config``'s, else the platform's (:func:`default_shape`)."""
    default_slots, default_len = default_shape(platform, cfg.max_position_embeddings)
    slots = slots if slots is not None else config.max_batch or default_slots
    cache_len = cache_len if cache_len is not None else config.max_cache_len or default_len
    block = _block_size(cfg, config)
    if cfg.num_layers < 2:
        raise ConfigError("decoding needs a model with at least 2 layers")
    if slots < 1:
        raise ConfigError(f"slots must be >= 1, got {slots}")
    return slots, cache_len, block


def _block_size(cfg: ModelConfig, config: GenerationConfig) -> int:
    """The block size an engine decodes with: ``config``'s, else the model's; never one the
    model was not trained with."""
    block = config.block_size or cfg.block_size
    if block is None:
        raise ConfigError("the model's config.json names no block_size: set "
                          "GenerationConfig(block_size=...) (4, 8, 16, 32 or 64)")
    if cfg.block_size is not None and block != cfg.block_size:
        raise ConfigError(f"block_size {block} does not match the model, which was trained "
                          f"with block size {cfg.block_size}")
    return block


def _token_ids(prompt: Sequence[int], vocab: int) -> list[int]:
    """A prompt's token ids as Python ints (lists, tuples, NumPy integer arrays): ``TypeError``
    for anything but integers (:func:`focus_jax.prompts.token_ids`), :class:`RequestError` for
    ids this model cannot take."""
    if isinstance(prompt, str):
        raise TypeError("a prompt for the engine is token ids: encode text first "
                        "(focus_jax.encode_prompt)")
    ids = token_ids(prompt)
    if not ids:
        raise RequestError("empty prompt: give at least one token")
    if min(ids) < 0 or max(ids) >= vocab:
        raise RequestError(f"prompt token ids must lie in [0, {vocab})")
    return ids


def run_to_completion(engine: Engine, *, progress: bool = False,
                      on_output: Callable[[RequestOutput], None] | None = None) -> dict[int, Result]:
    """Step ``engine`` until every request it holds has finished; their results by request id.

    ``progress`` shows a bar of generated tokens (a finished request counts its whole
    ``max_new_tokens``); ``on_output`` sees every output as it comes (streaming).
    """
    requests = [*engine.scheduler.waiting, *engine.scheduler.running.values()]
    bar = tqdm(total=sum(r.max_new_tokens for r in requests), unit="tok", disable=not progress,
               desc=engine.config.mode)
    budget = {r.rid: r.max_new_tokens for r in requests}
    results: dict[int, Result] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if on_output is not None:
                on_output(out)
            if out.finished:
                bar.update(budget.get(out.request_id, 0) - (len(out.token_ids) - len(out.new_token_ids)))
                results[out.request_id] = out.result()
            else:
                bar.update(len(out.new_token_ids))
    bar.close()
    return results
