"""The focus-jax command line."""

import os
import signal

import pytest

import focus_jax
from focus_jax.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    return focus_jax.save(model, tmp_path_factory.mktemp("cli") / "tiny")


def test_generate_streams_text_and_prints_stats(model_dir, capsys):
    code = main(["generate", "--model", str(model_dir), "--prompt", "hello", "--block-size", "4",
                 "--max-new-tokens", "8", "--threshold", "0.04", "--stats"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.strip()  # the streamed text
    assert "per step: processed" in err and "token-layers per generated token" in err
    # Where compiled programs are kept between runs, and how many were compiled or read back.
    from focus_jax.compilation import persistent_cache_folder

    assert f"read from the persistent cache {persistent_cache_folder()}," in err
    assert "programs compiled" in err


@pytest.fixture
def compile_cache_restored():
    import jax

    yield
    jax.config.update("jax_enable_compilation_cache", True)


def test_no_compile_cache_says_the_cache_is_off(model_dir, capsys, compile_cache_restored):
    code = main(["generate", "--model", str(model_dir), "--prompt", "hello", "--block-size", "4",
                 "--max-new-tokens", "8", "--threshold", "0.04", "--stats", "--no-compile-cache"])
    _, err = capsys.readouterr()
    assert code == 0 and "persistent cache off" in err


def test_generate_many_prompts_prints_each(model_dir, capsys):
    code = main(["generate", "--model", str(model_dir), "--prompt", "ab", "--prompt", "cd",
                 "--block-size", "4", "--max-new-tokens", "4", "--mode", "baseline"])
    out, _ = capsys.readouterr()
    assert code == 0 and out.count("### ") == 2


def test_missing_model_folder_is_an_error_message_not_a_traceback(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "does not exist" in err and "Traceback" not in err


def test_prompt_longer_than_max_position_embeddings_is_an_error(model_dir, capsys):
    code = main(["generate", "--model", str(model_dir), "--prompt", "x" * 5000,
                 "--block-size", "4", "--no-chat"])
    _, err = capsys.readouterr()
    assert code == 2 and "max_position_embeddings" in err


def test_eval_reports_every_task_and_mode_and_writes_markdown(model_dir, tmp_path, capsys):
    written = tmp_path / "quality.md"
    code = main(["eval", "--model", str(model_dir), "--per-task", "2", "--tasks", "copy,add",
                 "--modes", "baseline,focus", "--max-new-tokens", "8", "--markdown", str(written)])
    out, _ = capsys.readouterr()
    table = written.read_text()
    assert code == 0 and table.strip() in out
    for row in ("| baseline (0.9) |", "| focus + refresh (0.8) |", "| copy, baseline |",
                "| copy, focus + refresh |", "| add, baseline |", "| add, focus + refresh |"):
        assert row in table


def test_eval_draws_questions_with_its_seed_and_writes_json_with_the_commit_refresh(
        model_dir, tmp_path, capsys, monkeypatch):
    import json

    from focus_jax import evaluate, tasks

    seen = {}

    def record(model, examples, modes, **settings):
        seen.update(examples=examples, modes=modes, **settings)
        counts = evaluate.Counts(examples=2, correct=1, generated_tokens=4, processed_tokens=6,
                                 retained_tokens=2)
        return [evaluate.ModeReport("focus", 0.8, 4, {"copy": counts}, settings["commit_refresh"])]

    monkeypatch.setattr(evaluate, "evaluate", record)
    written = tmp_path / "eval.json"
    code = main(["eval", "--model", str(model_dir), "--per-task", "2", "--tasks", "copy",
                 "--modes", "focus", "--seed", "7", "--no-commit-refresh", "--json",
                 str(written)])
    out, _ = capsys.readouterr()
    questions = [e.question for e in seen["examples"]]
    assert code == 0 and seen["commit_refresh"] is False and seen["modes"] == ["focus"]
    assert questions == [e.question for e in tasks.held_out(2, 7, tasks=("copy",))]
    assert questions != [e.question for e in tasks.held_out(2, tasks=("copy",))]
    assert "| focus (0.8) |" in out and "refresh" not in out
    report = json.loads(written.read_text())
    assert report["seed"] == 7 and report["per_task"] == 2
    (mode,) = report["modes"]
    assert mode["mode"] == "focus" and mode["commit_refresh"] is False
    # 6 token-steps through layers 0-1 and 2 through the other 2 layers, per 4 tokens.
    assert mode["overall"]["token_layers_per_token"] == (2 * 6 + 2 * 2) / 4


def test_generate_takes_the_commit_refresh_and_otherwise_the_configs_default():
    from focus_jax import GenerationConfig
    from focus_jax.cli import _generation_config, build_parser

    def config(*options):
        return _generation_config(build_parser().parse_args(["generate", "--prompt", "x",
                                                             *options]))

    assert config().commit_refresh is GenerationConfig.commit_refresh
    assert config("--commit-refresh").commit_refresh is True
    assert config("--no-commit-refresh").commit_refresh is False


def test_eval_unknown_task_is_an_error_message(model_dir, capsys):
    code = main(["eval", "--model", str(model_dir), "--tasks", "copy,nope"])
    _, err = capsys.readouterr()
    assert code == 2 and "unknown task" in err and "Traceback" not in err


def test_demo_prompts_are_held_out_questions():
    from focus_jax import tasks
    from focus_jax.cli import DEMO_PROMPTS

    assert all(tasks.is_held_out(prompt) for prompt in DEMO_PROMPTS)


def test_demo_answers_its_prompts_with_the_bundled_model(capsys):
    from focus_jax import tasks
    from focus_jax.cli import BUNDLED_MODEL, DEMO_PROMPTS

    shards = list(BUNDLED_MODEL.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in BUNDLED_MODEL.iterdir()) <= 40 << 20
    assert shards and all(f.stat().st_size <= 16 << 20 for f in shards)
    assert main(["demo"]) == 0
    out, _ = capsys.readouterr()
    answers = [tasks.final_answer(line) for line in out.splitlines() if tasks.ANSWER_MARK in line]
    # The demo's questions, answered here by their own arithmetic.
    add, reverse, story = DEMO_PROMPTS
    a, b = add.removeprefix("Add: ").split("+")
    letters = reverse.removeprefix("Reverse: ").split()
    assert "12 apples, gets 9 more, gives away 6 and gets 3 more" in story
    assert answers == [str(int(a) + int(b)), " ".join(reversed(letters)), str(12 + 9 - 6 + 3)]


def test_serve_without_the_serve_extra_names_the_install_command():
    import subprocess
    import sys

    hide = "import sys; sys.modules['fastapi'] = None; from focus_jax.cli import main; "
    done = subprocess.run([sys.executable, "-c", hide + "sys.exit(main(['serve']))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "focus-jax: error: focus-jax serve needs fastapi, which is not installed: "
        "pip install 'focus-jax[serve]'")
    assert "Traceback" not in done.stderr


def test_serve_and_bench_give_xla_most_of_the_gpu_unless_told_otherwise(monkeypatch, tmp_path):
    missing = ["--model", str(tmp_path / "absent")]
    for command in (["serve", "--port", "0", *missing], ["bench", *missing]):
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
        assert main(command) == 2  # the folder is missing: after the setting, before the model
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95", command
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
        assert main(command) == 2
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5", command


def test_serve_with_a_broken_tokenizer_says_so_without_waiting_for_the_compile(tmp_path):
    """The tokenizer loads beside the compile and the weights' load; its error ends the server
    at once (one line, status 2), not after the compile running beside it: the decode round
    never reaches the compilation cache."""
    import os
    import socket
    import subprocess
    import sys

    folder = tmp_path / "model"
    folder.mkdir()
    for file in focus_jax.BUNDLED_MODEL.iterdir():
        (folder / file.name).symlink_to(file)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").write_text("{ not json")
    cache = tmp_path / "cache"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "focus_jax.cli", "serve", "--model", str(folder), "--port",
         str(port)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"focus-jax: error: {folder}/tokenizer.json is not valid JSON"), done.stderr
    assert "Traceback" not in done.stderr
    written = [p.name for p in cache.rglob("*")] if cache.exists() else []
    assert not [name for name in written if "decode_round" in name], written


def _sigint_at_its_default():
    """``preexec_fn`` of a child that a test sends SIGINT: it starts with SIGINT at its default
    disposition and unblocked, whatever this process has (a non-interactive shell's background
    job, ``make test &``, starts with SIGINT ignored, and an ignored signal stays ignored across
    exec: Python then installs no KeyboardInterrupt handler and the child ignores Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_ends_generate_at_once_with_status_130_and_no_traceback(tmp_path):
    import os
    import subprocess
    import sys
    import time

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Add: 1+2\nReverse: a b c\n" * 8)
    log = tmp_path / "stderr.txt"
    # One token per step (no token is above threshold 1): seconds of decoding to interrupt.
    command = [sys.executable, "-m", "focus_jax.cli", "generate", "--prompts-file", str(prompts),
               "--max-new-tokens", "256", "--threshold", "1"]
    with log.open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err,
                                   env={**os.environ, "JAX_PLATFORMS": "cpu"},
                                   preexec_fn=_sigint_at_its_default)
    try:
        deadline = time.monotonic() + 300
        while "%|" not in log.read_text() and time.monotonic() < deadline:  # decoding begun
            assert process.poll() is None, log.read_text()
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        code = process.wait(timeout=30)
    finally:
        process.kill()
    assert code == 130 and time.monotonic() - signalled < 10
    assert "Traceback" not in log.read_text() and "focus-jax: interrupted" in log.read_text()


def test_help_shows_every_options_default():
    import argparse

    from focus_jax.cli import build_parser

    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    assert {"generate", "serve", "train", "demo", "eval", "bench"} <= set(commands)
    for name, parser in commands.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.required or action.nargs == 0 or not action.option_strings:
                continue  # required, a flag (off unless given), or a positional argument
            shown = formatter._get_help_string(action)
            assert "default" in shown or "is required" in shown, (name, action.dest)


def test_serve_on_a_cpu_defaults_to_4_slots_of_256_positions(monkeypatch):
    pytest.importorskip("fastapi")
    import focus_jax.engine
    from focus_jax.config import ConfigError

    seen = {}

    class Stop(focus_jax.engine.Engine):
        def __init__(self, model, config, *, slots, cache_len, mesh=None):
            seen.update(slots=slots, cache_len=cache_len)
            raise ConfigError("stop here")

    monkeypatch.setattr(focus_jax.engine, "Engine", Stop)
    assert main(["serve", "--port", "0"]) == 2
    assert seen == {"slots": 4, "cache_len": 256}


def test_an_interrupt_python_cannot_propagate_prints_no_traceback(monkeypatch):
    """Ctrl-C can land in a garbage-collector callback (JAX registers one) or a ``__del__``,
    where Python prints "Exception ignored in ..." and a traceback and goes on: inside
    ``exit_promptly`` such a KeyboardInterrupt is not printed (the signal's watcher ends the
    process with its one line); any other exception there still reaches the usual hook."""
    import gc
    import sys

    from focus_jax.ctrl_c import exit_promptly

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(type(u.exc_value)))

    class RaisesWhenCollected:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    with exit_promptly():
        for error in (KeyboardInterrupt, ValueError):
            RaisesWhenCollected(error)
            gc.collect()
    assert reported == [ValueError]
    RaisesWhenCollected(KeyboardInterrupt)
    gc.collect()
    assert reported == [ValueError, KeyboardInterrupt]  # outside the block: the usual hook


def test_ctrl_c_inside_a_compile_ends_generate_within_seconds(tmp_path):
    """A compile does not return to Python for seconds (a minute for SDAR-8B on a GPU): the
    signal itself ends the command (focus_jax.ctrl_c), with one line and status 130."""
    import os
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "focus_jax.cli", "generate", "--prompt", "What is 2+2?",
               "--no-compile-cache"]  # compiles for about 10 s on 2 cores, after 3-5 s of loading
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                               preexec_fn=_sigint_at_its_default)
    try:
        time.sleep(6)
        assert process.poll() is None
        process.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and time.monotonic() - signalled < 3
    assert err.strip().splitlines() == ["focus-jax: interrupted"]


def test_generate_with_a_paged_cache_and_prefix_caching_prints_pages_and_hits(model_dir, capsys):
    """Two prompts that share their first blocks: the second reads them from the prefix cache
    (a batch of one slot runs them one after the other)."""
    shared = "Answer briefly. " * 2
    code = main(["generate", "--model", str(model_dir), "--prompt", shared + "hi",
                 "--prompt", shared + "yo", "--block-size", "4", "--max-new-tokens", "4",
                 "--threshold", "0.04", "--max-batch", "1", "--no-chat", "--kv-cache", "paged",
                 "--prefix-caching", "--stats"])
    _, err = capsys.readouterr()
    assert code == 0
    assert "from the prefix cache (hit rate" in err and "KV pages: at most" in err
    assert " 0 from the prefix cache" not in err
