"""The focus-jax command line."""

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
