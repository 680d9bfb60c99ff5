"""Static shapes: a long run compiles nothing after warm-up, and skipped work is really skipped
(XLA's compiled cost analysis of the decode step)."""

import dataclasses

import jax
import pytest

from focus_jax import GenerationConfig, quant
from focus_jax.compilation import count_compilations
from focus_jax.decoding import DecodeState, step
from focus_jax.engine import Engine, run_to_completion
from focus_jax.testing import random_prompts, tiny_model


@pytest.mark.parametrize("mode", ["baseline", "focus"])
def test_long_run_compiles_nothing_after_warmup(model, mode):
    config = GenerationConfig(mode=mode, block_size=4, threshold=0.04, max_new_tokens=12,
                              alpha=1.0)
    engine = Engine(model, config, slots=4, cache_len=64)
    with count_compilations() as warmup:
        engine.warmup()
    # One decode program (all bucket branches of both compactions inside it), the release of
    # aborted slots, and prefill programs per prompt-length bucket: of one request and of a
    # full prefill batch.
    assert 1 <= warmup.programs <= 2 + 2 * len(engine_prompt_buckets(engine))
    with count_compilations() as serving:
        for prompt in random_prompts(14, 128, 1, 40, seed=21):  # more prompts than slots
            engine.add_request(prompt)
        results = run_to_completion(engine)
    assert len(results) == 14
    assert serving.programs == 0
    # Every token-step is some request's: per-request totals (commit steps included) add up.
    for field in ("processed_tokens", "retained_tokens"):
        per_request = [getattr(r.stats, field) for r in results.values()]
        assert all(n > 0 for n in per_request) and sum(per_request) == getattr(engine.stats, field)
    assert len(engine.stats.retained_buckets) > 1  # several buckets were really used


def engine_prompt_buckets(engine):
    from focus_jax.engine import prompt_buckets
    return prompt_buckets(engine.block_size, engine.cache_len)


def step_flops(model, mode, processed_ladder, retained_ladder, slots=8, block=8, cache=32):
    """FLOPs of one compiled decode step whose compactions can only pick the given buckets."""
    config = GenerationConfig(mode=mode, block_size=block, max_new_tokens=8)
    engine = Engine(model, config, slots=slots, cache_len=cache)
    # Unrolled, so that the cost analysis counts every layer (it counts a loop body once).
    settings = dataclasses.replace(engine.settings, processed_ladder=processed_ladder,
                                   retained_ladder=retained_ladder, unroll_layers=True)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), engine.state)
    assert isinstance(engine.state, DecodeState)
    lowered = jax.jit(lambda s: step(model.module(), s, settings)).lower(state)
    return lowered.compile().cost_analysis()["flops"]


@pytest.fixture(scope="module")
def deep_model():
    # Deep and wide enough that the layers, not the padded reference attention, dominate.
    return tiny_model(num_layers=12, hidden_size=64, intermediate_size=256)


def test_branch_flops_grow_with_the_bucket(deep_model):
    total = 64
    flops = [step_flops(deep_model, "focus", (total,), (n,)) for n in (2, 8, 32, 64)]
    assert flops == sorted(flops) and flops[0] < flops[-1] / 2


def test_focus_step_in_the_smallest_bucket_costs_a_third_of_baseline(deep_model):
    total = 64
    baseline = step_flops(deep_model, "baseline", (total,), (total,))
    focus = step_flops(deep_model, "focus", (total,), (2,))
    assert focus <= baseline / 3


BENCH = dict(batch=4, requests=6, max_new_tokens=8, block_size=4, threshold=0.04, alpha=1.0)
"""The bench runs' shapes and settings, shared: a mode's programs compile once for both tests."""


def test_bench_counts_no_compilation_after_warmup_and_splits_the_wall_time(model):
    from focus_jax import bench

    results = bench.run(model, ["baseline", "focus"], **BENCH)
    for r in results:
        assert r.compilations == 0, r
        assert r.generated_tokens == 6 * 8  # no stop tokens: every request runs to the cap
        parts = (r.decode_seconds, r.prefill_seconds, r.host_seconds)
        assert all(p > 0 for p in parts) and sum(parts) <= r.wall_seconds, r
        assert r.retained_per_step <= r.processed_per_step
        # The LM head runs on the masks a step could decode: at least the decoded ones, at most
        # the retained rows.
        assert r.decoded_per_step <= r.sampled_per_step <= r.retained_per_step, r
    # The counter does count: a new shape compiles.
    with count_compilations() as events:
        jax.jit(lambda x: x * 3)(jax.numpy.ones(7))
    assert events.programs >= 1


def test_bench_frees_each_mode_engine_before_the_next(model, monkeypatch):
    """Two engines' KV caches at once would not fit at large batch (sdar-8b batch 256 with 1024
    new tokens: 72 GiB each): a mode's engine is gone before the next one is made."""
    import weakref

    from focus_jax import bench

    made = []

    def engine(*args, **kwargs):
        assert all(ref() is None for ref in made), "the previous mode's engine is still alive"
        made.append(weakref.ref(result := Engine(*args, **kwargs)))
        return result

    monkeypatch.setattr(bench, "Engine", engine)
    results = bench.run(model, ["baseline", "delayed", "focus"], **BENCH)
    assert [r.mode for r in results] == ["baseline", "delayed", "focus"] and len(made) == 3


def test_decode_round_temporaries_do_not_grow_with_depth():
    """The round reads each layer's weights from the stack in place: a copy of the stacked
    weights (as slicing them to ``[2:]`` once made) would grow its temporaries with depth."""

    def round_temporaries(num_layers: int) -> tuple[int, int]:
        model = tiny_model(seed=0, scale=4.0, num_layers=num_layers)
        # Two buckets: half the round's branches of the CPU's four (any copy of the stacked
        # weights shows in either).
        config = GenerationConfig(mode="focus", block_size=4, max_new_tokens=8,
                                  stop_token_ids=(), bucket_ladder=(0.5, 1.0))
        engine = Engine(model, config, slots=4, cache_len=64)
        compiled = engine.lower_round().compile()
        params = sum(x.nbytes for x in jax.tree.leaves(model.params))
        return compiled.memory_analysis().temp_size_in_bytes, params

    shallow, shallow_params = round_temporaries(4)
    deep, deep_params = round_temporaries(8)
    four_layers = deep_params - shallow_params
    assert deep - shallow < four_layers / 4, (shallow, deep, four_layers)


IN_PLACE_READERS = ("%dynamic-slice-fusion", "%gemm_fusion", "%triton_gemm")
"""The fused computations of XLA's GPU HLO that read a slice where it lies: a dynamic-slice
fusion (the operand of a cuBLAS GEMM), or a GEMM fusion that slices (and converts) its operand
inside the GEMM's own kernel."""


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="XLA's GPU dynamic-slice fusion")
@pytest.mark.parametrize("quantize", [None, "int8", "fp8"])
@pytest.mark.parametrize("mode", ["baseline", "focus"])
def test_gpu_layer_loop_reads_weights_in_place(mode, quantize):
    """On GPUs (compilation.GPU_COMPILER_OPTIONS) the layer loop of layers >= 2 copies no layer's
    weights out of the stack: each slice at the loop's layer index (a dynamic slice) lives in a
    dynamic-slice fusion, the operand of the GEMM that reads it in place (a concatenation, such
    as XLA's dot merger, now off in those options, makes of projections sharing their input, is
    tolerated). (Layers 0-1, at constant indices inside the bucket switches, are not covered:
    their slices are copied.) With 8-bit weights (``quantize``), each 8-bit weight is read in
    place as well: the dequantization belongs to the GEMM, not to a copy."""
    model = tiny_model(seed=0, num_layers=4, hidden_size=256, intermediate_size=512,
                       num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    model = model if quantize is None else quant.quantize(model, quantize)
    config = GenerationConfig(mode=mode, block_size=8, max_new_tokens=8, stop_token_ids=())
    engine = Engine(model, config, slots=8, cache_len=128)
    text = engine.lower_round().compile().as_text()
    hlo_types = {"bfloat16": "bf16", "int8": "s8", "float8_e4m3fn": "f8e4m3fn"}
    layer_matrices = {f"{hlo_types[x.dtype.name]}[1,{','.join(map(str, x.shape[1:]))}]"
                      for x in jax.tree.leaves(model.params)
                      if x.ndim >= 3 and x.shape[0] == model.config.num_layers
                      and 1 not in x.shape[1:]}  # weights, not their scales
    computation, copied, in_place = "", [], 0
    for line in text.splitlines():
        if line and not line[0].isspace() and "{" in line:
            computation = line.split()[0]
        result = line.split("=", 1)[1].split()[0].split("{")[0] if " = " in line else ""
        if " dynamic-slice(" in line and result in layer_matrices:
            if computation.startswith(IN_PLACE_READERS):
                in_place += 1
            elif "concatenate" not in computation:
                copied.append((computation, line.strip()[:160]))
    assert in_place > 0
    assert not copied, copied


def test_the_bundled_models_answer_is_the_same_with_the_cache_empty_warm_or_off(tmp_path):
    """`focus-jax generate` in fresh processes, the bundled bfloat16 model: with an empty
    persistent cache it compiles and writes every program, again it reads them all back, and
    with the cache off it compiles them afresh; the greedy answer is the same token for token
    each time. (An empty cache once answered with a whole-block round switched to the full
    bucket ladder mid-request, and this prompt's answer flipped at a near tie.)

    With libtpu installed on a host without TPU chips (CI's), the processes run as a user runs
    them (JAX_PLATFORMS unset) and print none of libtpu's initialisation errors (focus_jax keeps
    JAX from starting its TPU backend there; tests/libtpu_quiet.py)."""
    import os
    import re
    import subprocess
    import sys

    from focus_jax import tpu
    from tests.libtpu_quiet import LIBTPU_ERRORS, tpu_chips

    as_a_user = tpu.libtpu_installed() and not tpu_chips()
    folder = tmp_path / "xla"
    command = [sys.executable, "-m", "focus_jax.cli", "generate", "--prompt", "What is 2+2?",
               "--stats"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "FOCUS_JAX_CACHE_DIR": str(folder)}
    if as_a_user:
        del env["JAX_PLATFORMS"]
    counts, answers = [], []
    for extra, where in (([], str(folder)), ([], str(folder)), (["--no-compile-cache"], "off")):
        done = subprocess.run(command + extra, capture_output=True, text=True, timeout=600,
                              env=env)
        assert done.returncode == 0, done.stderr
        assert not (as_a_user and [e for e in LIBTPU_ERRORS if e in done.stderr]), done.stderr
        line = re.search(r"compilation: (\d+) programs compiled, (\d+) read from the "
                         r"persistent cache (\S+),", done.stderr)
        assert line and line[3] == where, done.stderr
        counts.append((int(line[1]), int(line[2])))
        answers.append(done.stdout)
    (compiled, read), (compiled_again, read_again), (compiled_off, read_off) = counts
    # The prefill and the decode round at least, compiled the first time and read back after.
    assert compiled >= 2 and read == 0 and any(folder.iterdir())
    assert (compiled_again, read_again) == (0, compiled)
    assert (compiled_off, read_off) == (compiled, 0)  # the same programs, compiled afresh
    assert answers[0].strip() and answers[2] == answers[1] == answers[0]


def test_program_cache_releases_the_least_recently_used():
    from focus_jax.compilation import ProgramCache

    made = []
    cache = ProgramCache(capacity=2)
    def get(key):
        return cache.get(key, lambda: made.append(key) or (lambda: key))

    get("a"), get("b"), get("a"), get("c")  # "b" is the least recently used when "c" comes
    assert len(cache) == 2 and made == ["a", "b", "c"]
    assert get("a")() == "a" and made == ["a", "b", "c"]  # kept
    get("b")
    assert made == ["a", "b", "c", "b"]  # made again: it had been released


def test_settings_beyond_the_cap_release_their_compiled_programs(model, monkeypatch):
    """A long-lived process that meets ever new settings keeps the executables of at most
    ``capacity`` programs alive (jax.jit alone keeps every setting's)."""
    import gc

    from focus_jax import compilation, generate

    monkeypatch.setattr(compilation, "PROGRAMS", compilation.ProgramCache(capacity=2))
    client = jax.devices()[0].client

    def live_after(alphas):
        for alpha in alphas:
            generate(model, [20, 21, 22], GenerationConfig(block_size=4, max_new_tokens=4,
                                                           alpha=alpha, bucket_ladder=(1.0,)))
        gc.collect()
        return len(client.live_executables())

    # Each setting has its own decode round; the prefill is shared (its settings do not change).
    two = live_after([1.01, 1.02])
    six = live_after([1.03, 1.04, 1.05, 1.06])
    assert six <= two, (two, six)
    assert len(compilation.PROGRAMS) == 2


def test_the_bucket_ladder_does_not_change_the_bundled_models_tokens_in_float32():
    """Buckets pad the same rows to other sizes: on the CPU the bundled model's answers, in
    float32, are the same token for token with one bucket and with eight (every size of the
    shorter ladders, the CPU's among them).
    (In bfloat16 another row count rounds differently and can flip a near tie: with the commit
    refresh one of these eight answers does; docs/startup.md, "One decode program per
    engine".)"""
    import focus_jax
    from focus_jax import tasks
    from focus_jax.cli import BUNDLED_MODEL

    model = focus_jax.load(BUNDLED_MODEL, dtype="float32")
    questions = [e.question for e in tasks.held_out(2, tasks=tasks.WORKED)[:8]]
    answers = {}
    for ladder in [(1.0,), tuple(k / 8 for k in range(1, 9))]:
        config = GenerationConfig(mode="focus", max_new_tokens=64, bucket_ladder=ladder)
        answers[ladder] = [r.token_ids for r in focus_jax.generate(model, questions, config)]
    first, *others = answers.values()
    assert all(len(ids) > 0 for ids in first)
    assert all(other == first for other in others)


def test_a_warmup_compiling_side_by_side_leaves_nothing_to_compile(model, monkeypatch):
    """With several warm-up workers (a many-core GPU host) the round and the prefill programs
    compile on the workers' threads at once; serving then compiles nothing, and the tokens are
    those of an engine warmed up one program at a time."""
    import threading

    from jax import monitoring

    from focus_jax import compilation

    config = GenerationConfig(mode="focus", block_size=4, threshold=0.04, max_new_tokens=12,
                              bucket_ladder=(0.5, 1.0), steps_per_round=6)  # programs of its own
    # Prompts of 2-18 tokens and their answers fit 32 positions: six prompt buckets (4-32) to
    # compile at each of two row counts, in each of the two warm-ups.
    prompts = random_prompts(6, 128, 2, 18, seed=8)
    threads = []

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == compilation.BACKEND_COMPILE:
            threads.append(threading.current_thread().name)

    monkeypatch.setattr(compilation, "WARMUP_WORKERS", 3)
    # An accelerator's prefill batch (a CPU's is 1): prefill programs of two row counts.
    engine = Engine(model, config, slots=4, cache_len=32, prefill_batch=4)
    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        with compilation.persistent_cache_off():
            engine.warmup()
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
    on_workers = [name for name in threads if name.startswith("focus_jax_warmup")]
    # The round and two row counts of prefill at each prompt bucket, all on the workers; the
    # warm-up's runs of them after that compile nothing (only the small release program).
    assert len(on_workers) == 1 + 2 * len(engine_prompt_buckets(engine)), threads
    assert len(threads) - len(on_workers) <= 1, threads
    with count_compilations() as serving:
        ids = [engine.add_request(p) for p in prompts]
        results = run_to_completion(engine)
    assert serving.programs == 0

    monkeypatch.setattr(compilation, "WARMUP_WORKERS", 1)
    compilation.PROGRAMS.clear()  # compiled afresh, one at a time
    sequential = Engine(model, config, slots=4, cache_len=32, prefill_batch=4)
    sequential.warmup()
    expected_ids = [sequential.add_request(p) for p in prompts]
    expected = run_to_completion(sequential)
    assert [results[i].token_ids for i in ids] == [expected[i].token_ids for i in expected_ids]


def test_programs_compiled_side_by_side_are_traced_one_at_a_time():
    # A trace can import a kernel's library on first use; two at once can be handed a
    # half-initialised module (tokamax on the H200). Each trace below waits long enough for
    # another worker to start its own, were traces not kept apart.
    import threading
    import time

    import jax.numpy as jnp

    from focus_jax import compilation

    active, most = [0], [0]
    lock = threading.Lock()

    def traced(x):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        return x + 1

    programs = [(jax.jit(traced), (jnp.zeros(n),), {}) for n in range(1, 5)]
    compilation.compile_together(programs, workers=4)
    assert most[0] == 1
