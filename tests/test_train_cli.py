"""`focus-jax train` from the command line: resuming, refusing another run, and its errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import focus_jax
from focus_jax.cli import main
from focus_jax.testing import tiny_model

# A `focus-jax train` process that dies like a killed one (os._exit: no cleanup, no checkpoint
# on the way out) when its fourth step begins: steps 1-3 are done and logged, and it waits
# first for the checkpoint of step 2 to be complete on disk.
KILLED_AT_STEP_4 = """
import os, sys, time
from pathlib import Path
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import focus_jax.train.trainer as trainer
from focus_jax.cli import main
out, calls, step = Path(sys.argv[1]), [], trainer._train_step
def dying_step(*args):
    calls.append(None)
    if len(calls) == 4:
        while not (out / "train_state" / "2").is_dir():
            time.sleep(0.05)
        os._exit(137)
    return step(*args)
trainer._train_step = dying_step
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return focus_jax.save(tiny_model(tokenizer=True, block_size=8),
                          tmp_path_factory.mktemp("train_cli") / "tiny")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train_data") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {w}", "response": w}) + "\n"
                            for w in ("hi", "yo", "ok", "no")))
    return path


def command(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model_dir), "--data", str(data), "--out", str(out),
            "--steps", "6", "--batch-size", "2", "--seq-len", "24", "--learning-rate", "3e-3",
            "--log-every", "1", "--checkpoint-every", "2", *extra]


@pytest.fixture(scope="module")
def finished(model_dir, data, tmp_path_factory) -> Path:
    """The folder of an uninterrupted run of ``command``."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(command(model_dir, data, out)) == 0
    return out


def weights(folder: Path) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(focus_jax.load(folder).params)]


def logged_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]


def error_of(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(model_dir, data, finished,
                                                                    tmp_path):
    killed = tmp_path / "killed"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    dead = subprocess.run([sys.executable, "-c", KILLED_AT_STEP_4, str(killed),
                           *command(model_dir, data, killed)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert dead.returncode == 137, dead.stderr
    assert logged_steps(killed) == [1, 2, 3] and not (killed / "model").exists()
    assert main(command(model_dir, data, killed)) == 0  # the same command again
    assert logged_steps(killed) == [1, 2, 3, 4, 5, 6]  # step 3 trained again, logged once
    for a, b in zip(weights(finished / "model"), weights(killed / "model"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ctrl_c_saves_and_says_the_same_command_resumes(model_dir, data, finished, tmp_path,
                                                       monkeypatch, capsys):
    import signal

    import focus_jax.train.trainer as trainer

    out, calls, step = tmp_path / "run", [], trainer._train_step

    def step_then_ctrl_c(*args):
        calls.append(None)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return step(*args)

    monkeypatch.setattr(trainer, "_train_step", step_then_ctrl_c)
    assert main(command(model_dir, data, out)) == 130
    assert "interrupted at step 3 of 6" in capsys.readouterr().err
    monkeypatch.setattr(trainer, "_train_step", step)
    assert main(command(model_dir, data, out)) == 0
    assert logged_steps(out) == [1, 2, 3, 4, 5, 6]
    for a, b in zip(weights(finished / "model"), weights(out / "model"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_finished_run_trains_nothing_more_and_another_run_is_refused(model_dir, data, finished,
                                                                       tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = weights(out / "model")
    assert main(command(model_dir, data, out)) == 0
    assert logged_steps(out) == [1, 2, 3, 4, 5, 6]
    for a, b in zip(before, weights(out / "model"), strict=True):
        np.testing.assert_array_equal(a, b)
    capsys.readouterr()
    assert "learning_rate 0.003 (now 0.001)" in error_of(
        [*command(model_dir, data, out), "--learning-rate", "1e-3"], capsys)
    other_data = tmp_path / "other.jsonl"
    other_data.write_text(data.read_text() + json.dumps({"prompt": "a", "response": "b"}) + "\n")
    assert "other data" in error_of(command(model_dir, other_data, out), capsys)
    other_model = focus_jax.save(tiny_model(seed=1, tokenizer=True, block_size=8), tmp_path / "m")
    assert "another initial model (its weights differ)" in error_of(
        command(other_model, data, out), capsys)
    assert main([*command(model_dir, data, out), "--learning-rate", "1e-3", "--overwrite"]) == 0
    assert logged_steps(out) == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "run.json").read_text())["learning_rate"] == 1e-3


def test_the_exported_config_says_the_block_size_trained_with(model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert main([*command(model_dir, data, out), "--steps", "1", "--block-size", "4"]) == 0
    assert json.loads((out / "model" / "config.json").read_text())["block_size"] == 4


@pytest.mark.parametrize(("extra", "culprit"), [
    (["--block-size", "7"], "--block-size 7 is not supported"),
    (["--batch-size", "0"], "--batch-size must be > 0, got 0"),
    (["--steps", "-1"], "--steps must be > 0"),
    (["--learning-rate", "nan"], "--learning-rate must be > 0, got nan"),
    (["--seq-len", "20"], "--seq-len 20 is not a multiple of the block size 8"),
])
def test_bad_options_are_one_line_errors_naming_the_option(model_dir, data, tmp_path, capsys,
                                                           extra, culprit):
    assert culprit in error_of([*command(model_dir, data, tmp_path / "run"), *extra], capsys)
    assert not (tmp_path / "run").exists()


def test_an_out_that_is_a_file_or_a_foreign_folder_is_refused(model_dir, data, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("x")
    assert f"{file} is a file" in error_of(command(model_dir, data, file), capsys)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert "holds no training run" in error_of(
        [*command(model_dir, data, foreign), "--overwrite"], capsys)
    assert (foreign / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(("content", "culprit"), [
    (b'{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": }\n',
     "pairs.jsonl:2: not valid JSON"),
    (b'{"prompt": "a", "response": "b"}\n{"prompt": 3, "response": "b"}\n',
     "pairs.jsonl:2: 'prompt' and 'response' must be strings"),
    (b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff", "response": "b"}\n',
     "pairs.jsonl:2: not UTF-8 text"),
    (b'[1, 2]\n', "pairs.jsonl:1: each line must be a JSON object"),
])
def test_a_bad_data_file_is_an_error_naming_its_line(model_dir, tmp_path, capsys, content,
                                                     culprit):
    data = tmp_path / "pairs.jsonl"
    data.write_bytes(content)
    assert culprit in error_of(command(model_dir, data, tmp_path / "run"), capsys)


def test_a_data_path_that_is_a_folder_or_missing_is_an_error(model_dir, tmp_path, capsys):
    assert f"{tmp_path} is a folder" in error_of(command(model_dir, tmp_path, tmp_path / "a"), capsys)
    missing = tmp_path / "missing.jsonl"
    assert f"{missing} does not exist" in error_of(command(model_dir, missing, tmp_path / "b"),
                                                   capsys)


def test_train_defaults_to_the_bundled_model_and_a_cpu_sized_run(tmp_path, monkeypatch):
    """Without --model, the bundled model; on a CPU, a run of seconds per step (10 steps of 4
    sequences of 160 tokens)."""
    import types

    from focus_jax import cli, train

    seen = {}

    def load_model(path, dtype=None, mesh=None):
        seen["model"] = (path, dtype)
        return types.SimpleNamespace(config=types.SimpleNamespace(block_size=32))

    def pair_source(model, data, batch_size, seq_len, seed):
        seen["source"] = (batch_size, seq_len)
        raise cli.ConfigError("stop here")

    monkeypatch.setattr(cli, "load_model", load_model)
    monkeypatch.setattr(train, "PairSource", pair_source)
    assert cli.main(["train", "--data", str(tmp_path / "pairs.jsonl"),
                     "--out", str(tmp_path / "run")]) == 2
    assert seen == {"model": (None, "float32"), "source": (4, 160)}
    assert cli.TRAIN_DEFAULTS["steps"][0] == 10
