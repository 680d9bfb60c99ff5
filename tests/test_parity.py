"""Our uncached block-causal forward against transformers' Qwen3ForCausalLM (fixtures made by
scripts/make_parity_fixtures.py with a 4-D additive block-causal mask, float32)."""

from pathlib import Path

import numpy as np
import pytest

import focus_jax

FIXTURES = Path(__file__).parent / "fixtures" / "parity"


@pytest.mark.parametrize("case", ["sdar_tied", "qwen3_untied"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_block_causal_logits_match_transformers(case, block_size):
    model = focus_jax.load(FIXTURES / case, dtype="float32", tokenizer=False)
    reference = np.load(FIXTURES / case / "reference_logits.npz")
    logits = np.asarray(model.logits(reference["tokens"], block_size))
    expected = reference[f"logits_b{block_size}"]
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() <= 1e-4


def test_fixture_heads_are_what_the_cases_claim():
    tied = focus_jax.load(FIXTURES / "sdar_tied", dtype="float32", tokenizer=False)
    untied = focus_jax.load(FIXTURES / "qwen3_untied", dtype="float32", tokenizer=False)
    assert tied.config.tie_word_embeddings and tied.config.model_type == "sdar"
    assert not untied.config.tie_word_embeddings and untied.config.model_type == "qwen3"
    assert tied.config.num_heads // tied.config.num_kv_heads > 1


def test_block_size_changes_the_logits():
    # The mask matters: the same tokens under block sizes 4 and 8 give different logits.
    model = focus_jax.load(FIXTURES / "sdar_tied", dtype="float32", tokenizer=False)
    tokens = np.load(FIXTURES / "sdar_tied" / "reference_logits.npz")["tokens"]
    assert not np.allclose(np.asarray(model.logits(tokens, 4)), np.asarray(model.logits(tokens, 8)))


def test_bfloat16_forward_stays_close_to_float32():
    f32 = focus_jax.load(FIXTURES / "qwen3_untied", dtype="float32", tokenizer=False)
    bf16 = focus_jax.load(FIXTURES / "qwen3_untied", dtype="bfloat16", tokenizer=False)
    tokens = np.load(FIXTURES / "qwen3_untied" / "reference_logits.npz")["tokens"]
    a, b = np.asarray(f32.logits(tokens, 4)), np.asarray(bf16.logits(tokens, 4))
    assert b.dtype == np.float32
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 3e-2
