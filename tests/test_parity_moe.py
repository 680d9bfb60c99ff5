"""Our Qwen3-MoE forward against transformers' Qwen3MoeForCausalLM (fixtures made by
scripts/make_parity_fixtures.py in float32 with a 4-D additive block-causal mask): logits, and
each sparse layer's router choices."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import focus_jax
from focus_jax.models.decoder import router_choices

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
CASES = ["sdar_moe_tiny", "qwen3_moe_sparse_step"]


def load(case: str, dtype: str = "float32") -> focus_jax.Model:
    return focus_jax.load(FIXTURES / case, dtype=dtype, tokenizer=False)


def reference(case: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / case / "reference_logits.npz") as npz:
        return {key: npz[key] for key in npz.files}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", [4, 8])
def test_block_causal_logits_match_transformers(case, block_size):
    model = load(case)
    expected = reference(case)
    logits = np.asarray(model.logits(expected["tokens"], block_size))
    assert logits.shape == expected[f"logits_b{block_size}"].shape
    assert np.abs(logits - expected[f"logits_b{block_size}"]).max() <= 1e-4


@pytest.mark.parametrize("case", CASES)
def test_router_choices_match_transformers_in_every_sparse_layer(case):
    model = load(case)
    expected = reference(case)
    decoder, tokens = model.module(), jnp.asarray(expected["tokens"])
    choices = np.asarray(jax.jit(lambda: router_choices(decoder, tokens, 4))())
    sparse = [int(i) for i in expected["sparse_layers"]]
    assert [i for i, kind in enumerate(model.config.layer_kinds) if kind == "sparse"] == sparse
    for layer in sparse:
        np.testing.assert_array_equal(choices[layer], expected[f"experts_b4_layer{layer}"])
    assert all((choices[i] == -1).all() for i in range(len(choices)) if i not in sparse)


def test_dense_and_sparse_layers_are_stacked_per_kind():
    model = load("qwen3_moe_sparse_step")
    decoder = model.module()
    assert model.config.layer_kinds == ("dense", "sparse", "dense", "dense")
    assert [(r.start, r.stop, r.kind, r.offset) for r in decoder.runs] == [
        (0, 1, "dense", 0), (1, 2, "sparse", 0), (2, 4, "dense", 1)]
    assert decoder.mlp.gate_up_proj.shape == (3, 64, 2, 96)
    assert decoder.moe.gate_up_proj.shape == (1, 8, 64, 2, 32)
    assert decoder.layers.attn.qkv_proj.shape[0] == 4


def test_bfloat16_moe_forward_stays_close_to_float32():
    tokens = reference("sdar_moe_tiny")["tokens"]
    a = np.asarray(load("sdar_moe_tiny").logits(tokens, 4))
    b = np.asarray(load("sdar_moe_tiny", "bfloat16").logits(tokens, 4))
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 5e-2


@pytest.mark.parametrize("case", CASES)
def test_converted_orbax_folder_gives_the_same_logits_and_config(case, tmp_path):
    from focus_jax.checkpoint import convert

    out = convert(FIXTURES / case, tmp_path / "converted", dtype="float32")
    assert (out / "params").is_dir()
    converted = focus_jax.load(out, dtype="float32", tokenizer=False)
    original = load(case)
    assert converted.config == original.config
    tokens = reference(case)["tokens"]
    np.testing.assert_array_equal(np.asarray(converted.logits(tokens, 4)),
                                  np.asarray(original.logits(tokens, 4)))
