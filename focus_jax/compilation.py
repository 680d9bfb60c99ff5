"""Compiled programs: the engine's jitted prefill and decode round, kept per setting in a bounded
cache; compiles side by side (a warm-up on a many-core host); and JAX's persistent compilation
cache, which keeps compiled programs between processes.

``jax.jit`` with static arguments keeps every combination it has seen, with its executables, for
the life of the process (37 MiB of RSS per decode-round setting of the bundled model with the
CPU ladder: docs/startup.md). Here each setting gets its own jitted function in a
least-recently-used cache of ``PROGRAM_CAPACITY`` entries; an evicted function's executables are
freed once no engine holds it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import jax
from flax import nnx
from jax import monitoring

from focus_jax import decoding

PROGRAM_CAPACITY = 8
"""Jitted programs (a prefill or a decode round, per setting and state shape) kept per process."""

CACHE_DIR_ENV = "FOCUS_JAX_CACHE_DIR"
PERSISTENT_CACHE_MAX_BYTES = 4 * 2**30
"""The persistent cache's size limit: past it, JAX deletes the least recently read entries."""

SOURCE_PATH_PREFIX = r"^.*?/(?=(?:focus_jax|pallas_kernels)/)|^.*/(?:site|dist)-packages/"
"""What source locations drop of a file's path (JAX's ``hlo_source_file_canonicalization_regex``):
the folder the project or a package is installed in. JAX's cache key strips a program's source
locations, but not those inside a Mosaic GPU kernel (tokamax's grouped matmul), whose serialized
module sits in the program: with whole paths there, a cached mixture-of-experts program would be
found again only from the same install folder."""

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"

# XLA options for the serving programs on GPUs. Every layer's weights are a slice of the stacked
# weights; by default XLA copies each slice out (a memcpy of the layer's weights, every layer of
# every step: 7.5 ms of a 72 ms sdar-8b batch-256 step). Dynamic-slice fusion lets a cuBLAS GEMM
# read its slice in place, but XLA's Triton GEMM fusions take no part in it, so those are off
# (docs/benchmarks.md, "Weight reads"). XLA's dot merger would join the q, k and v projections
# into one GEMM on a weight concatenated afresh every layer of every step; three GEMMs reading
# in place are faster (-0.8 ms per step there).
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True,
                        "xla_gpu_enable_triton_gemm": False,
                        "xla_disable_hlo_passes": "dot-merger"}


class ProgramCache:
    """Values made on first request and kept by key, at most ``capacity`` of them; the least
    recently requested is dropped when a new one would exceed it. Thread-safe."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[Hashable, Callable] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Callable]) -> Callable:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            value = self._entries[key] = make()
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


PROGRAMS = ProgramCache(PROGRAM_CAPACITY)


CPU_COMPILER_OPTIONS: dict[str, object] | None = None
"""XLA options of the CPU programs made from now on, over the process's ``XLA_FLAGS`` (None:
those alone). The tests compile cheaply (``focus_jax.testing.TEST_XLA_FLAGS``) and set XLA's
optimising backend here for engines that run far more than they compile
(``focus_jax.testing.optimising_cpu_compiles``)."""


def _jit(fn: Callable, platform: str, static_argnames: tuple[str, ...] = ()) -> Callable:
    if not _cache_checked:
        use_persistent_cache()
    options = (GPU_COMPILER_OPTIONS if platform in ("gpu", "cuda", "rocm")
               else CPU_COMPILER_OPTIONS if platform == "cpu" else None)
    # The decode state (argument 1) is donated: updated in place.
    return jax.jit(fn, donate_argnums=(1,), compiler_options=options,
                   static_argnames=static_argnames)


def prefill_program(platform: str, graphdef: nnx.GraphDef, settings: decoding.DecodeSettings,
                    slots: int, cache_len: int, pages: int | None = None) -> Callable:
    """The jitted prefill for devices of ``platform`` ("cpu", "gpu", "tpu"):
    ``(params, state, tokens [n, t], length [n], slot [n], slot_params) -> state``
    (``slot_params``: the requests' :class:`~focus_jax.decoding.SlotParams`, ``n`` rows).

    Kept in :data:`PROGRAMS` by model, block size, mask token, mesh and state shape (``pages``:
    a paged cache's pool); it compiles once per padded prompt length.
    """
    block, mask = settings.block_size, settings.mask_token_id

    def make() -> Callable:
        def prefill(params, state, tokens, length, slot, slot_params):
            return decoding.prefill(nnx.merge(graphdef, params), state, tokens, length, slot,
                                    slot_params, block, mask, settings.mesh)

        return _jit(prefill, platform)

    key = ("prefill", platform, graphdef, block, mask, settings.mesh, slots, cache_len, pages)
    return PROGRAMS.get(key, make)


def prefix_prefill_program(platform: str, graphdef: nnx.GraphDef,
                           settings: decoding.DecodeSettings, slots: int, cache_len: int,
                           pages: int | None) -> Callable:
    """The jitted prefill of prompts that continue a cached prefix: ``(params, state, tokens [n,
    p + c], length [n], start [n], slot [n], slot_params, *, computed=c) -> state``; each row's
    positions ``[start, start + c)`` are run, attending to its cached positions before
    ``start`` (``start <= p``; the runner reads the whole cache, ``p = cache_len``). Compiles
    once per ``(n, p, c)``; kept like :func:`prefill_program`."""
    block, mask = settings.block_size, settings.mask_token_id

    def make() -> Callable:
        def prefill(params, state, tokens, length, start, slot, slot_params, *, computed):
            return decoding.prefill(nnx.merge(graphdef, params), state, tokens, length, slot,
                                    slot_params, block, mask, settings.mesh, start, computed)

        return _jit(prefill, platform, static_argnames=("computed",))

    key = ("prefix_prefill", platform, graphdef, block, mask, settings.mesh, slots, cache_len,
           pages)
    return PROGRAMS.get(key, make)


def decode_round_program(platform: str, graphdef: nnx.GraphDef,
                         settings: decoding.DecodeSettings, max_steps: int, slots: int,
                         cache_len: int, pages: int | None = None) -> Callable:
    """The jitted decode round (``decoding.decode_round``) for devices of ``platform``:
    ``(params, state, stop_on_finish, step_limit, stop_on_first_output, interrupt_channel) ->
    (state, results, steps)``, ``results`` the round's step logs and slot progress packed for one
    transfer (``decoding.pack_round``).

    Kept in :data:`PROGRAMS` by model, settings, steps per round and state shape (``pages``: a
    paged cache's pool): one compiled program per entry.
    """
    def make() -> Callable:
        def decode_round(params, state, stop_on_finish, step_limit, stop_on_first_output,
                         interrupt_channel):
            history_at_start = state.history
            state, logs, ran = decoding.decode_round(nnx.merge(graphdef, params), state,
                                                     settings, max_steps, stop_on_finish,
                                                     step_limit, stop_on_first_output,
                                                     interrupt_channel)
            return state, decoding.pack_round(state, logs, ran, history_at_start), ran

        return _jit(decode_round, platform)

    key = ("round", platform, graphdef, settings, max_steps, slots, cache_len, pages)
    return PROGRAMS.get(key, make)


# ---------------------------------------------------------------------------- compiling a warm-up
def shape_of(leaf: object) -> object:
    """An argument's stand-in for lowering, as ``jax.jit`` would see it (an uncommitted array
    given a sharding, or a weak type lost, would make another program)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):  # already a stand-in (a model of shapes)
        return leaf
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type,
                                    sharding=leaf.sharding if leaf.committed else None)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) if hasattr(leaf, "dtype") else leaf


_LOWERING = threading.Lock()
"""Programs are traced and lowered one at a time (a second or two each at SDAR-30B-A3B, against
a minute or more of compiling): a trace can import a kernel's library on first use, and while
one thread's import is failing, another can be handed the half-initialised module instead of
the error (seen on the H200: tokamax without pydantic gave ``module 'tokamax' has no attribute
'ragged_dot'``)."""


def _compile(program: Callable, shapes: tuple, static: dict) -> None:
    """Compile the jitted ``program`` for the argument stand-ins ``shapes`` and its static
    keyword arguments ``static``: calling it with arguments of those shapes then compiles
    nothing (``jax.jit`` keeps the executable)."""
    with _LOWERING:
        lowered = program.lower(*shapes, **static)
    lowered.compile()


CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
WARMUP_WORKERS = max(1, min(4, CORES // 4))
"""Programs a warm-up compiles at once: one per four cores, at most four (one on the 2-core CI
machine, four on a 16-core GPU host). XLA's passes over one program run on one thread; its
code generation already spreads over the cores."""


def compile_together(programs: list[tuple[Callable, tuple, dict]],
                     workers: int | None = None) -> None:
    """Compile each jitted ``(program, args, static)`` for arguments shaped like ``args`` (and
    the static keyword arguments ``static``), ``workers`` (default :data:`WARMUP_WORKERS`) at
    a time, longest first as listed. The first compile error is raised."""
    shaped, seen = [], set()
    for program, args, static in programs:
        entry = (program, jax.tree.map(shape_of, args), static)  # before donation
        key = (id(program), repr(entry[1]), repr(static))  # engines share some programs
        if key not in seen:
            seen.add(key)
            shaped.append(entry)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers or WARMUP_WORKERS,
                                               thread_name_prefix="focus_jax_warmup") as pool:
        for future in [pool.submit(_compile, *entry) for entry in shaped]:
            future.result()


release_program = jax.jit(decoding.release, donate_argnums=(0,))
"""``(state, slots [S]) -> state``: the requests in ``slots`` (aborted) take no further steps
(one small program per state shape)."""

set_pages_program = jax.jit(decoding.set_pages, donate_argnums=(0,))
"""``(state, slots [S], table [S, W]) -> state``: page-table rows for slots of a paged cache."""


# --------------------------------------------------------------------- persistent compilation cache
_cache_checked = False
"""Whether :func:`use_persistent_cache` ran in this process (engines call it once)."""


def default_cache_folder() -> Path:
    """Where compiled programs are kept between processes: ``$FOCUS_JAX_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/focus_jax/xla``, else ``~/.cache/focus_jax/xla``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "focus_jax" / "xla"


def use_persistent_cache(folder: Path | None = None) -> Path | None:
    """Turn JAX's persistent compilation cache on in ``folder`` (default:
    :func:`default_cache_folder`) for programs compiled from now on, unless the process chose
    its own folder (``jax_compilation_cache_dir``, e.g. from ``JAX_COMPILATION_CACHE_DIR``) or
    turned the cache off (``jax_enable_compilation_cache``: ``JAX_ENABLE_COMPILATION_CACHE=0``,
    ``focus-jax --no-compile-cache``). Returns the folder in use, or None. Engines call it
    before their first compilation. Source locations name files from their package on
    (:data:`SOURCE_PATH_PREFIX`), unless the process chose its own rule."""
    global _cache_checked
    _cache_checked = True
    if not jax.config.jax_hlo_source_file_canonicalization_regex:
        jax.config.update("jax_hlo_source_file_canonicalization_regex", SOURCE_PATH_PREFIX)
    if not jax.config.jax_enable_compilation_cache:
        return None
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    folder = folder or default_cache_folder()
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # JAX keeps only programs that took >= 1 s to compile by default; a 2-core CPU compiles the
    # small prefill programs in less, and reading any of them back is faster than compiling.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", PERSISTENT_CACHE_MAX_BYTES)
    return folder


@contextlib.contextmanager
def _jax_config(name: str, value: object) -> Iterator[None]:
    """JAX's option ``name`` set to ``value`` while the block runs, then restored."""
    before = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


def persistent_cache_off() -> contextlib.AbstractContextManager[None]:
    """The persistent compilation cache is neither read nor written while the block runs."""
    return _jax_config("jax_enable_compilation_cache", False)


def not_persisted() -> contextlib.AbstractContextManager[None]:
    """Compilations while the block runs are not written to the persistent compilation cache
    (its threshold of compile time is raised past any compile, in this process, for the block).
    For programs compiled for compile-only devices (TPU topologies on a CPU machine): no process
    can load them back ("PjRtCompiler must be constructed with a Client"), so an entry is dead
    weight and a warning each time a later compile finds it."""
    return _jax_config("jax_persistent_cache_min_compile_time_secs", math.inf)


def persistent_cache_folder() -> Path | None:
    """The persistent compilation cache's folder in this process (None: off)."""
    if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
        return None
    return Path(jax.config.jax_compilation_cache_dir)


# ----------------------------------------------------------------------------- counting compiles
@dataclasses.dataclass
class Compilations:
    """XLA programs a block of code asked the backend for."""

    compiled: int = 0
    """Compiled afresh."""
    loaded: int = 0
    """Read back from the persistent compilation cache."""
    seconds: float = 0.0
    """Wall time of both."""
    names: list[str] = dataclasses.field(default_factory=list)
    """The programs' names (``jit(decode_round)``, ...), compiled or read back, in order."""

    @property
    def programs(self) -> int:
        return self.compiled + self.loaded


@contextlib.contextmanager
def count_compilations() -> Iterator[Compilations]:
    """Counts the backend compilations (and persistent-cache reads) while the block runs."""
    seen = Compilations()

    def on_duration(event: str, duration: float, **kwargs: object) -> None:
        if event == BACKEND_COMPILE:
            seen.compiled += 1
            seen.seconds += duration
            seen.names.append(str(kwargs.get("fun_name", "")))

    def on_event(event: str, **kwargs: object) -> None:
        # A cache read is also reported as a backend compile; count it once, as a load.
        if event == CACHE_HIT:
            seen.loaded += 1
            seen.compiled -= 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
        monitoring.unregister_event_listener(on_event)
