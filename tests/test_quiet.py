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


def test_only_the_listed_transformers_messages_are_dropped(caplog):
    import focus_jax  # noqa: F401  (installs the filter)

    logger = logging.getLogger("transformers")
    with caplog.at_level(logging.WARNING, logger="transformers"):
        logger.warning("PyTorch was not found. Models won't be available ...")
        logger.warning("something else that matters")
    assert [r.getMessage() for r in caplog.records] == ["something else that matters"]


def check_tokenization():
    spec = importlib.util.spec_from_file_location("check_tokenization",
                                                  REPO / "scripts" / "check_tokenization.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not SDAR_TOKENIZER.is_dir(), reason="no SDAR tokenizer files in ../shared")
def test_sdar_tokenizer_loads_without_the_mistral_warning_and_tokenizes_as_qwen2(tmp_path,
                                                                                 caplog):
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
    with caplog.at_level(logging.WARNING, logger="transformers"):
        tokenizer = load_tokenizer(tmp_path)
    assert not [r for r in caplog.records if "incorrect regex pattern" in r.getMessage()]
    script = check_tokenization()
    reference = script.ByteLevelBPE(tmp_path)
    texts = script.strings(150)
    assert [tokenizer.encode(t, add_special_tokens=False) for t in texts] == [
        reference.encode(t) for t in texts]
