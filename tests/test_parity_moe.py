"""Our Qwen3-MoE forward against transformers' Qwen3MoeForCausalLM (fixtures made by
scripts/make_parity_fixtures.py in float32 with a 4-D additive block-causal mask): logits, and
each sparse layer's router choices."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import focus_jax
from focus_jax.models.decoder import block_causal_mask, dense_attention
from focus_jax.models.moe import MoE

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
CASES = ["sdar_moe_tiny", "qwen3_moe_sparse_step"]


def load(case: str, dtype: str = "float32") -> focus_jax.Model:
    return focus_jax.load(FIXTURES / case, dtype=dtype, tokenizer=False)


def reference(case: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / case / "reference_logits.npz") as npz:
        return {key: npz[key] for key in npz.files}


def router_choices(model: focus_jax.Model, tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Every layer's chosen experts ``[L, b, t, k]`` in the uncached block-causal forward (-1
    in dense layers), ascending per token."""
    decoder = model.module()
    tokens = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    mask = block_causal_mask(tokens.shape[1], block_size)
    k = model.config.moe.experts_per_token

    def body(layer, x, _):
        q, keys, values = layer.qkv(x, positions)
        attn = dense_attention(q, keys, values, mask)
        after_attention = x + layer.block.attn.output(attn.astype(x.dtype))
        if isinstance(layer.feed_forward, MoE):
            normed = layer.block.post_attn_norm(after_attention)
            experts = layer.feed_forward.route(normed.reshape(-1, normed.shape[-1]))[0]
        else:
            experts = jnp.full((x.shape[0] * x.shape[1], k), -1, jnp.int32)
        return layer.finish(x, attn), experts.reshape(*x.shape[:2], k)

    _, experts = jax.jit(lambda: decoder.scan_layers(body, decoder.embed_tokens(tokens)))()
    return np.sort(np.asarray(experts), axis=-1)


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
    choices = router_choices(model, expected["tokens"], 4)
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
