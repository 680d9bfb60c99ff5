"""Dependency messages that do not apply to focus_jax are not shown; the rest of their output
is. SDAR's (Qwen2) tokenizer loads without transformers' Mistral-regex warning and tokenizes as
an independent byte-level BPE of its vocab.json and merges.txt does."""

import gzip
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# shared/ lies beside the clone (CI, the main checkout) or beside its worktrees' folder.
SDAR_TOKENIZER = next((p / "shared" / "peer" / "sdar_tokenizer" for p in REPO.parents[:2]
                       if (p / "shared" / "peer" / "sdar_tokenizer").is_dir()),
                      REPO.parent / "shared" / "peer" / "sdar_tokenizer")


def test_importing_focus_jax_and_transformers_prints_nothing():
    done = subprocess.run([sys.executable, "-c", "import focus_jax.cli, transformers"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


class Logged(logging.Handler):
    """Records that reach the "transformers" logger's handlers (transformers stops them from
    propagating to the root logger once it is imported, so pytest's caplog misses them)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "Logged":
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("transformers").removeHandler(self)


def test_only_the_listed_transformers_messages_are_dropped():
    import focus_jax  # noqa: F401  (installs the filters)

    config = logging.getLogger("transformers.configuration_utils")
    with Logged() as logged:
        logging.getLogger("transformers").warning("PyTorch was not found. Models won't ...")
        for model_type in ("sdar", "sdar_moe", "llada2_moe"):
            config.warning(f"You are using a model of type `{model_type}` to instantiate a model "
                           f"of type ``. This may be expected ...")
        config.warning("You are using a model of type `llama` to instantiate a model of type "
                       "`qwen3`.")
        logging.getLogger("transformers").warning("something else that matters")
    assert [m[:40] for m in logged.messages] == [
        "You are using a model of type `llama` to", "something else that matters"]


def check_tokenization():
    spec = importlib.util.spec_from_file_location("check_tokenization",
                                                  REPO / "scripts" / "check_tokenization.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not SDAR_TOKENIZER.is_dir(), reason="no SDAR tokenizer files in ../shared")
def test_sdar_tokenizer_loads_without_the_mistral_warning_and_tokenizes_as_qwen2(tmp_path):
    from focus_jax.checkpoint import load_tokenizer

    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        plain, packed = SDAR_TOKENIZER / name, SDAR_TOKENIZER / f"{name}.gz"
        if plain.exists():
            shutil.copy2(plain, tmp_path / name)
        else:
            (tmp_path / name).write_bytes(gzip.decompress(packed.read_bytes()))
    # As the random SDAR folders of the benchmarks: no transformers_version, which is what
    # made transformers take it for a Mistral tokenizer.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "sdar"}))
    with Logged() as logged:
        tokenizer = load_tokenizer(tmp_path)
    assert logged.messages == []  # neither the Mistral-regex warning nor the sdar model type
    script = check_tokenization()
    reference = script.ByteLevelBPE(tmp_path)
    texts = script.strings(150)
    assert [tokenizer.encode(t, add_special_tokens=False) for t in texts] == [
        reference.encode(t) for t in texts]
