"""Our LLaDA2 (``llada2_moe``) forward against an independent NumPy reference written from the
public modeling semantics (tests/llada2_reference.py, which names the source of each), on tiny
random checkpoints in the real weight layout (tests/llada2_checkpoint.py): logits and every MoE
layer's router choices, in float32 under block-causal masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import focus_jax
from focus_jax.config import ConfigError
from focus_jax.models.decoder import block_causal_mask, router_choices
from tests.llada2_checkpoint import write_tiny_llada2
from tests.llada2_reference import llada2_reference


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llada2")
    write_tiny_llada2(path, seed=0)
    return path


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 96, size=(2, 16)).astype(np.int32)


@pytest.mark.parametrize("block_size", [4, 8])
def test_logits_and_router_choices_match_the_reference(folder, block_size):
    model = focus_jax.load(folder, dtype="float32", tokenizer=False)
    ids = tokens(block_size)
    expected, expected_choices = llada2_reference(folder, ids, np.asarray(
        block_causal_mask(ids.shape[1], block_size)), dtype=np.float64)
    logits = np.asarray(model.logits(ids, block_size))
    assert np.abs(logits - expected).max() <= 1e-4
    decoder = model.module()
    every_layer = np.asarray(jax.jit(lambda: router_choices(decoder, jnp.asarray(ids),
                                                            block_size))())
    choices = {i: every_layer[i] for i, kind in enumerate(model.config.layer_kinds)
               if kind == "sparse"}
    assert sorted(choices) == sorted(expected_choices) == [1, 2]
    for layer, chosen in choices.items():
        np.testing.assert_array_equal(chosen, expected_choices[layer])


def test_the_config_reads_llada2s_fields(folder):
    cfg = focus_jax.load(folder, dtype="float32", tokenizer=False).config
    m = cfg.moe
    assert cfg.layer_kinds == ("dense", "sparse", "sparse")
    assert cfg.rotary_dim == cfg.head_dim // 2
    assert (m.scores, m.expert_bias, m.num_groups, m.groups_per_token) == ("sigmoid", True, 4, 2)
    assert m.shared_expert_size == m.expert_size and m.routed_scaling_factor != 1.0


def test_saved_weights_load_back_in_the_real_layout(folder, tmp_path):
    from focus_jax.models.weights import read_safetensors, save_safetensors

    model = focus_jax.load(folder, dtype="float32", tokenizer=False)
    save_safetensors(model.module(), tmp_path)
    written = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in read_safetensors(f).items()}
    original = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in read_safetensors(f).items()}
    assert written.keys() == original.keys()
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("n_group", 3, "does not divide into n_group"),
    ("topk_group", 9, "topk_group"),
    ("num_experts_per_tok", 99, "num_experts_per_tok"),
    ("first_k_dense_replace", 7, "first_k_dense_replace"),
    ("score_function", "relu", "score_function"),
    ("use_qkv_bias", True, "use_qkv_bias"),
])
def test_an_inconsistent_moe_config_names_the_field(tmp_path, field, value, message):
    write_tiny_llada2(tmp_path, seed=0, **{field: value})
    with pytest.raises(ConfigError, match=message):
        focus_jax.load(tmp_path, dtype="float32", tokenizer=False)


def test_converted_orbax_folder_gives_the_same_logits_and_config(folder, tmp_path):
    from focus_jax.checkpoint import convert

    out = convert(folder, tmp_path / "converted", dtype="float32")
    converted = focus_jax.load(out, dtype="float32", tokenizer=False)
    original = focus_jax.load(folder, dtype="float32", tokenizer=False)
    assert converted.config == original.config and converted.config.moe.expert_bias
    ids = tokens(3)
    np.testing.assert_array_equal(np.asarray(converted.logits(ids, 4)),
                                  np.asarray(original.logits(ids, 4)))
