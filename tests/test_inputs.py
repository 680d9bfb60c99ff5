"""Bad inputs fail early with a message naming the culprit: exit code 2 and one line on the command
line; ConfigError, RequestError or TypeError in the API. Good inputs in other types (NumPy token
ids) are taken."""

import dataclasses
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import focus_jax
from focus_jax import GenerationConfig, bench, compilation, distributed, evaluate, tasks
from focus_jax.cli import main
from focus_jax.compilation import count_compilations
from focus_jax.config import ConfigError
from focus_jax.engine import Engine, RequestError, run_to_completion

# Small and shared by the decoding tests below, so that they compile once.
SMALL = GenerationConfig(block_size=4, max_new_tokens=4, bucket_ladder=(0.5, 1.0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    return focus_jax.save(model, tmp_path_factory.mktemp("inputs") / "tiny")


def run_cli(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *needles):
    lines = [line for line in err.splitlines() if line.startswith("focus-jax: error:")]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# ------------------------------------------------------------------------------ settings (API)
@pytest.mark.parametrize(("field", "value"), [
    ("temperature", math.nan), ("top_p", math.nan), ("alpha", math.inf), ("threshold", "0.5"),
    ("max_new_tokens", 2.5), ("max_new_tokens", True), ("block_size", 32.0), ("top_k", 1.5),
    ("seed", 0.5), ("max_batch", 0), ("denoising_steps", 0.5), ("stop_token_ids", (1.5,)),
    ("stop_token_ids", "ab"), ("bucket_ladder", (0.5, math.nan, 1.0)),
    ("commit_refresh", "false"), ("commit_refresh", 1),
])
def test_settings_that_would_be_truncated_or_are_nan_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=f"^{field} must be"):
        GenerationConfig(**{field: value})


def test_settings_in_numpy_types_are_taken_as_python_numbers():
    config = GenerationConfig(max_new_tokens=np.int64(8), temperature=np.float32(0.5),
                              stop_token_ids=[np.int64(3)], bucket_ladder=[0.5, 1])
    assert type(config.max_new_tokens) is int and config.max_new_tokens == 8
    assert type(config.temperature) is float and config.temperature == 0.5
    assert config.stop_token_ids == (3,) and config.bucket_ladder == (0.5, 1.0)
    hash(config)  # lists became tuples: the config stays hashable


def test_each_platform_takes_its_own_default_ladder_unless_one_is_given():
    from focus_jax.config import CPU_LADDER, DEFAULT_LADDER, GPU_LADDER

    assert GenerationConfig().ladder_for("cpu") == CPU_LADDER
    assert GenerationConfig().ladder_for("gpu") == GPU_LADDER
    assert GenerationConfig().ladder_for("tpu") == DEFAULT_LADDER
    assert GenerationConfig(bucket_ladder=(1.0,)).ladder_for("cpu") == (1.0,)


# -------------------------------------------------------------------------------- prompts (API)
@pytest.mark.parametrize(("prompts", "message"), [
    (b"2+2=", "prompt is bytes"),
    ({"role": "user", "content": "hi"}, "prompt has type dict"),
    ([5.0, 6.0], r"prompt: token 0 is 5\.0 \(float\)"),
    ([[5, 6], [7, 8.5]], r"prompt 1: token 1 is 8\.5"),
    ([5, True], r"token 1 is True \(bool\)"),
    (np.array([5.0, 6.0]), "dtype float64"),
    (["hi", b"there"], "prompt 1 is bytes"),
    (7, "prompts must be text, token ids or a list of them, got int"),
])
def test_prompts_that_are_neither_text_nor_token_ids_are_a_type_error(model, prompts, message):
    with pytest.raises(TypeError, match=message):
        focus_jax.generate(model, prompts, SMALL)


def test_no_prompts_and_a_wrong_config_are_refused(model):
    with pytest.raises(RequestError, match="no prompts"):
        focus_jax.generate(model, [], SMALL)
    with pytest.raises(TypeError, match="config must be a GenerationConfig, got dict"):
        focus_jax.generate(model, [5, 6], {"max_new_tokens": 4})


def test_numpy_token_ids_are_taken_like_lists(model):
    ids = [20, 21, 22, 23, 24]
    config = SMALL.replace(max_batch=2)  # one engine shape for every call: one compile
    [expected] = focus_jax.generate(model, ids, config)
    for prompt in (np.array(ids), np.array(ids, np.int32), [np.int64(t) for t in ids]):
        [result] = focus_jax.generate(model, prompt, config)
        assert result.token_ids == expected.token_ids
    # A 2-D array is a list of prompts, one per row.
    rows = focus_jax.generate(model, np.array([ids, ids[::-1]]), config)
    assert len(rows) == 2 and rows[0].token_ids == expected.token_ids


def test_engine_add_request_refuses_float_token_ids(model):
    engine = Engine(model, SMALL, slots=1, cache_len=16)
    with pytest.raises(TypeError, match=r"token 1 is 2\.7"):
        engine.add_request([1, 2.7])


# ----------------------------------------------------------------------- evaluation and bench
def test_evaluate_and_bench_refuse_empty_work_by_name(model):
    examples = tasks.held_out(1, tasks=("copy",))
    with pytest.raises(ConfigError, match="no examples"):
        evaluate.evaluate(model, [])
    with pytest.raises(ConfigError, match="no modes"):
        evaluate.evaluate(model, examples, modes=())
    with pytest.raises(ConfigError, match="max_batch must be an integer >= 1, got 0"):
        evaluate.evaluate(model, examples, max_batch=0)
    with pytest.raises(ConfigError, match="batch must be an integer >= 1, got 0"):
        bench.run(model, ["focus"], batch=0, requests=1, max_new_tokens=4, block_size=4)
    with pytest.raises(ConfigError, match="mode 'fast'"):
        bench.run(model, ["fast"], batch=1, requests=1, max_new_tokens=4, block_size=4)


# --------------------------------------------------------------------------- the command line
def test_an_empty_prompts_file_is_reported_as_empty(tmp_path, capsys):
    for name, content in (("empty.txt", ""), ("blank.txt", "\n  \n")):
        (tmp_path / name).write_text(content)
        code, _, err = run_cli(["generate", "--prompts-file", str(tmp_path / name)], capsys)
        assert code == 2 and f"{tmp_path / name} is empty" in err and "--prompt TEXT" not in err


def test_prompts_file_that_is_a_folder_or_not_utf8_is_named(tmp_path, capsys):
    code, _, err = run_cli(["generate", "--prompts-file", str(tmp_path)], capsys)
    one_line_error(code, err, str(tmp_path), "is a folder")
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"first prompt\nsecond \xff prompt\n")
    code, _, err = run_cli(["generate", "--prompts-file", str(bad)], capsys)
    one_line_error(code, err, f"{bad}:2: not UTF-8")


@pytest.mark.parametrize(("argv", "needles"), [
    (["generate", "--prompt", "x", "--temperature", "nan"], ["temperature", "nan"]),
    (["generate", "--prompt", "x", "--mesh", ","], ["bad mesh ','"]),
    (["generate", "--prompt", "x", "--mesh", "data=2,data=2"], ["bad mesh"]),
    (["generate", "--prompt", "x", "--max-batch", "0"], ["max_batch", ">= 1"]),
    (["generate", "--prompt", "x", "--bucket-ladder", "0.5,half"], ["--bucket-ladder"]),
    (["generate", "--prompt", "x", "--num-processes", "2"], ["--coordinator"]),
    (["generate", "--prompt", "x", "--coordinator", "nohost", "--num-processes", "2",
      "--process-id", "0"], ["--coordinator 'nohost'", "HOST:PORT"]),
    (["generate", "--prompt", "x", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
      "--process-id", "2"], ["--process-id", "0..1"]),
    (["generate", "--prompt", "x", "--distributed", "--join-timeout", "nan"], ["--join-timeout"]),
    (["eval", "--per-task", "0"], ["--per-task", "0"]),
    (["eval", "--modes", "baseline,fast"], ["--modes", "fast"]),
    (["bench", "--batches", "0"], ["--batches '0'"]),
    (["bench", "--batches", "8,many"], ["--batches '8,many'"]),
    (["bench", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["bench", "--kernels", "triton"], ["--kernels", "'triton' run only on GPUs", "CPU"]),
    (["bench", "--compile-only", "--request-rate", "2"], ["--compile-only", "--request-rate"]),
    (["serve", "--kernels", "pallas_triton"], ["--kernels", "only on GPUs"]),
    (["demo", "--max-new-tokens", "0"], ["max_new_tokens"]),
])
def test_bad_options_are_one_line_errors_before_any_model_loads(argv, needles, capsys,
                                                                 monkeypatch):
    from focus_jax import cli

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli, "load_model", no_loading)
    monkeypatch.setattr(bench, "measured_bf16_peak", no_loading)
    monkeypatch.setattr(bench, "random_model", no_loading)
    code, _, err = run_cli(argv, capsys)
    one_line_error(code, err, *needles)


def test_bench_prints_a_small_peak_in_significant_digits(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(bench, "measured_bf16_peak", lambda: 4.2e10)  # a CPU's: 0.042 TFLOP/s
    monkeypatch.setattr(bench, "compile_runs", lambda *args, **kwargs: 0.0)  # runs none
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: [])
    code, out, _ = run_cli(["bench", "--model", str(model_dir), "--batches", "1"], capsys)
    assert code == 0 and "measured bf16 peak 0.042 TFLOP/s" in out


@pytest.mark.parametrize(("kernels", "message"), [
    ("triton", "'triton' run only on GPUs, not on this CPU"),
    ("pallas_tpu", "run only on TPUs"),
    ("cuda", "unknown kernels 'cuda'"),
])
def test_an_engine_refuses_kernels_its_devices_cannot_run(model, kernels, message):
    with pytest.raises(ConfigError, match=message):
        Engine(model, GenerationConfig(kernels=kernels, block_size=4), slots=2, cache_len=64)
    # Those that run anywhere are taken.
    Engine(model, GenerationConfig(kernels="pallas_triton_interpret", block_size=4), slots=2,
           cache_len=64)


def test_bench_hands_its_kernels_and_ladder_to_every_run(model_dir, capsys, monkeypatch):
    seen, compiled = [], []
    monkeypatch.setattr(bench, "measured_bf16_peak", lambda: 4.2e10)
    monkeypatch.setattr(bench, "compile_runs",
                        lambda *args, **kwargs: compiled.append(kwargs) or 0.0)
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: seen.append(kwargs) or [])
    code, _, _ = run_cli(["bench", "--model", str(model_dir), "--batches", "1,2", "--kernels",
                          "xla", "--bucket-ladder", "0.5,1", "--commit-refresh"], capsys)
    assert code == 0 and len(seen) == 2
    assert len(compiled) == 1  # the runs' programs compiled first, with the same settings
    assert all(k["kernels"] == "xla" and k["bucket_ladder"] == (0.5, 1.0)
               and k["commit_refresh"] is True for k in seen + compiled)


def test_bench_requests_give_every_batch_the_same_request_set(model_dir, capsys, monkeypatch):
    """``--requests N``: N requests at every batch (one request set to compare batches on);
    without it, ``--requests-per-slot`` x the batch; both at once is refused."""
    seen = []
    monkeypatch.setattr(bench, "measured_bf16_peak", lambda: 4.2e10)
    monkeypatch.setattr(bench, "compile_runs", lambda *args, **kwargs: 0.0)
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: seen.append(args[3]) or [])
    for extra in (["--requests", "6"], ["--requests-per-slot", "3"]):
        code, _, _ = run_cli(["bench", "--model", str(model_dir), "--batches", "1,2", *extra],
                             capsys)
        assert code == 0
    assert seen == [6, 6, 3, 6]
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        main(["bench", "--requests", "6", "--requests-per-slot", "3"])
    assert refused.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    code, _, err = run_cli(["bench", "--requests", "0"], capsys)
    one_line_error(code, err, "--requests must be > 0")


def test_bench_compile_only_warms_up_and_serves_nothing(model, monkeypatch):
    def no_serving(*args, **kwargs):
        raise AssertionError("--compile-only served requests")

    monkeypatch.setattr(bench, "run_to_completion", no_serving)
    [r] = bench.run(model, ["delayed"], 2, 2, 8, block_size=4, compile_only=True)
    assert r.warmup_compiled + r.warmup_loaded > 0 and r.generated_tokens == 0


def test_a_model_of_weight_shapes_compiles_the_programs_its_weights_then_run(model):
    """``bench --compile-only`` holds no weights: an engine of weight shapes compiles the same
    round and prefill programs (same arguments, shardings and weak types) that the engine of
    the real weights then runs without compiling; it refuses to run anything itself."""
    shapes = dataclasses.replace(model, params=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.params))
    config = GenerationConfig(mode="focus", block_size=4, max_new_tokens=8, stop_token_ids=())
    compiler = Engine(shapes, config, slots=3, cache_len=24)
    with count_compilations() as first:
        compiler.warmup(prompt_lengths=[5], run=False)
    assert {"jit(decode_round)", "jit(prefill)"} <= set(first.names), first.names
    with pytest.raises(ConfigError, match="weight shapes only can compile"):
        compiler.warmup(prompt_lengths=[5])
    engine = Engine(model, config, slots=3, cache_len=24)
    with count_compilations() as again:
        engine.warmup(prompt_lengths=[5])
        request = engine.add_request([5, 6, 7, 8, 9])
        outputs = run_to_completion(engine)
    assert not {"jit(decode_round)", "jit(prefill)"} & set(again.names), again.names
    assert len(outputs[request].token_ids) == 8


def test_a_described_folder_compiles_while_its_weights_load():
    """``focus-jax serve`` compiles from the folder's description (config and tokenizer read,
    no weights) while the weights load: the loaded model is the described one with weights
    (same structure, shapes and dtypes), and its engine finds every program compiled."""
    from focus_jax.checkpoint import describe, load_weights
    from focus_jax.cli import BUNDLED_MODEL
    from focus_jax.engine import compile_ahead

    described = describe(BUNDLED_MODEL)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(described.params))
    config = GenerationConfig(mode="focus", max_new_tokens=8)
    # A shape no other test uses: its programs are compiled here, not found in memory.
    compiler = Engine(described, config, slots=3, cache_len=40)
    with count_compilations() as first:
        ahead = compile_ahead(compiler)
        model = load_weights(described, BUNDLED_MODEL)
        ahead.join()
    assert "jit(decode_round)" in first.names, first.names
    assert model.graphdef == described.graphdef and model.config == described.config
    assert jax.tree.map(compilation.shape_of, model.params) == described.params
    engine = Engine(model, config, slots=3, cache_len=40)
    with count_compilations() as again:
        engine.warmup()
    assert not {"jit(decode_round)", "jit(prefill)"} & set(again.names), again.names


def test_the_server_sizes_a_memory_sized_pool_once_for_the_compile_and_the_loaded_engine(
        monkeypatch):
    """A paged pool sized by the memory left after the weights would come out larger before the
    weights are on the device than after: the server sizes it once, from the description, so
    the loaded engine's programs are those compiled while it loaded (one round compiled)."""
    from focus_jax import cli
    from focus_jax.checkpoint import TokenizerLoad, describe
    from focus_jax.engine import core
    from focus_jax.engine.runner import is_abstract

    def pool_pages(model, config, *args):  # more memory free while nothing is loaded
        return config.kv_pages or (12 if is_abstract(model.params) else 10)

    monkeypatch.setattr(core, "pool_pages", pool_pages)
    tokenizer = TokenizerLoad(cli.BUNDLED_MODEL)  # as the server: loading beside the rest
    described = describe(cli.BUNDLED_MODEL, tokenizer=tokenizer)
    config = GenerationConfig(mode="focus", max_new_tokens=8, kv_cache="paged")
    with count_compilations() as seen:
        engine = cli._load_and_compile(described, cli.BUNDLED_MODEL, config, 2, 40, None, None,
                                       tokenizer)
    assert engine.scheduler.pool.total == 12
    assert seen.names.count("jit(decode_round)") == 1, seen.names


def test_bench_compiles_every_runs_programs_first_and_the_runs_compile_none(model, monkeypatch):
    """``bench`` with several batches (or modes) compiles all their programs at once, before the
    first run; each run then compiles none of them, even where the process keeps fewer
    programs than the runs need together (here two)."""
    monkeypatch.setattr(compilation.PROGRAMS, "capacity", 2)
    with count_compilations() as first:
        # Batches no other test runs: their rounds are compiled here, not found in memory.
        bench.compile_runs(model, ["delayed"], [3, 5], 1, 8, block_size=4, workers=2)
    assert first.names.count("jit(decode_round)") == 2, first.names
    for batch in (3, 5):
        with count_compilations() as again:
            bench.run(model, ["delayed"], batch, batch, 8, block_size=4)
        assert not {"jit(decode_round)", "jit(prefill)"} & set(again.names), again.names


def test_compiled_programs_name_their_source_files_from_the_package_on(model):
    """Source locations inside a program (which a Mosaic GPU kernel's serialized module keeps
    in the compilation cache's key) hold no install folder: a cached program is found again
    from another folder (a copied cache, another checkout)."""
    engine = Engine(model, GenerationConfig(mode="focus", block_size=4, max_new_tokens=8,
                                            stop_token_ids=()), slots=2, cache_len=16)
    text = engine.runner.lower_round().as_text(debug_info=True)
    root = str(Path(focus_jax.__file__).resolve().parents[1])
    assert '"focus_jax/decoding.py"' in text and root + "/focus_jax" not in text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_that_never_comes_is_waited_for_a_bounded_time_with_a_message():
    """Process 0 of 2 alone: it says what it waits for, and ends with exit code 2 at the
    timeout (JAX's own timeout would abort the process). A subprocess: the exit ends it."""
    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "focus_jax.cli", "generate", "--prompt", "x",
         "--coordinator", address, "--num-processes", "2", "--process-id", "0",
         "--join-timeout", "2"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done.stderr
    assert f"waiting up to 2 s for the other 1 process(es) to join at {address}" in done.stderr
    assert f"focus-jax: error: not all 2 processes joined at {address} within 2 s" in done.stderr


def test_a_peer_without_its_coordinator_says_so_after_the_timeout(capsys):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConfigError, match=f"no coordinator answered at {address}"):
        distributed.initialize(address, 2, 1, timeout_seconds=1)
    assert "process 1 of 2: waiting up to 1 s" in capsys.readouterr().err
