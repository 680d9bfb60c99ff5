"""The Qwen3-MoE parity fixtures hold what they claim (NumPy only: no torch, no model code).

Made by scripts/make_parity_fixtures.py from transformers' Qwen3MoeForCausalLM; see its docstring for the
checkpoint layout (per-expert tensors, as in the real Qwen3-30B-A3B / SDAR-30B-A3B checkpoints)."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
CASES = ["sdar_moe_tiny", "qwen3_moe_sparse_step"]
BATCH, SEQ_LEN = 2, 24


def config(case):
    return json.loads((FIXTURES / case / "config.json").read_text())


def reference(case):
    with np.load(FIXTURES / case / "reference_logits.npz") as npz:
        return {key: npz[key] for key in npz.files}


def tensor_shapes(case):
    # A safetensors file opens with the little-endian length of its JSON header, which names every tensor.
    with open(FIXTURES / case / "model.safetensors", "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"}


def sparse_layers(cfg):
    # Qwen3MoeDecoderLayer's rule.
    return [i for i in range(cfg["num_hidden_layers"])
            if i not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0
            and (i + 1) % cfg["decoder_sparse_step"] == 0]


def test_the_cases_cover_both_router_normalisations_and_heads():
    sdar, qwen = config("sdar_moe_tiny"), config("qwen3_moe_sparse_step")
    assert sdar["model_type"] == "sdar_moe" and qwen["model_type"] == "qwen3_moe"
    assert {sdar["norm_topk_prob"], qwen["norm_topk_prob"]} == {True, False}
    assert {sdar["tie_word_embeddings"], qwen["tie_word_embeddings"]} == {True, False}


@pytest.mark.parametrize("case", CASES)
def test_config_uses_the_hub_keys(case):
    cfg = config(case)
    assert "num_local_experts" not in cfg  # transformers 5's name; hub checkpoints write num_experts
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (8, 2, 32)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]) == (64, 96, 96)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)


def test_sdar_case_is_all_sparse_and_the_mixed_case_mixes():
    sdar, mixed = config("sdar_moe_tiny"), config("qwen3_moe_sparse_step")
    assert sparse_layers(sdar) == list(range(sdar["num_hidden_layers"]))
    sparse = sparse_layers(mixed)
    dense = [i for i in range(mixed["num_hidden_layers"]) if i not in sparse]
    assert sparse and dense
    # Each rule decides a layer: the step makes some layers dense, and mlp_only_layers one the step
    # alone would have made sparse.
    step, (only,) = mixed["decoder_sparse_step"], mixed["mlp_only_layers"]
    assert any((i + 1) % step for i in dense) and (only + 1) % step == 0


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_has_per_expert_tensors_for_sparse_layers_and_an_mlp_for_dense_ones(case):
    cfg, shapes = config(case), tensor_shapes(case)
    hidden, inter, moe_inter = cfg["hidden_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    sparse = sparse_layers(cfg)
    for i in range(cfg["num_hidden_layers"]):
        mlp = f"model.layers.{i}.mlp"
        got = {name: shape for name, shape in shapes.items() if name.startswith(mlp + ".")}
        if i in sparse:
            want = {f"{mlp}.gate.weight": (cfg["num_experts"], hidden)}
            for e in range(cfg["num_experts"]):
                want[f"{mlp}.experts.{e}.gate_proj.weight"] = (moe_inter, hidden)
                want[f"{mlp}.experts.{e}.up_proj.weight"] = (moe_inter, hidden)
                want[f"{mlp}.experts.{e}.down_proj.weight"] = (hidden, moe_inter)
        else:
            want = {f"{mlp}.gate_proj.weight": (inter, hidden), f"{mlp}.up_proj.weight": (inter, hidden),
                    f"{mlp}.down_proj.weight": (hidden, inter)}
        assert got == want, i
    assert ("lm_head.weight" in shapes) != cfg["tie_word_embeddings"]


@pytest.mark.parametrize("case", CASES)
def test_reference_holds_tokens_logits_and_the_experts_of_each_sparse_layer(case):
    cfg, ref = config(case), reference(case)
    sparse = sparse_layers(cfg)
    assert ref["sparse_layers"].tolist() == sparse
    assert set(ref) == {"tokens", "sparse_layers", "logits_b4", "logits_b8",
                        *(f"experts_b4_layer{i}" for i in sparse)}
    assert ref["tokens"].shape == (BATCH, SEQ_LEN) and ref["tokens"].dtype == np.int32
    for key in ("logits_b4", "logits_b8"):
        assert ref[key].shape == (BATCH, SEQ_LEN, cfg["vocab_size"]) and ref[key].dtype == np.float32
        assert np.isfinite(ref[key]).all()
    assert not np.allclose(ref["logits_b4"], ref["logits_b8"])  # the block size mattered
    for i in sparse:
        experts = ref[f"experts_b4_layer{i}"]
        assert experts.shape == (BATCH, SEQ_LEN, cfg["num_experts_per_tok"]) and experts.dtype == np.int32
        assert (np.diff(experts, axis=-1) > 0).all()  # sorted ascending, no expert twice
        assert experts.min() >= 0 and experts.max() < cfg["num_experts"]


@pytest.mark.parametrize("case", CASES)
def test_routing_varies_across_tokens_in_every_sparse_layer(case):
    cfg, ref = config(case), reference(case)
    for i in sparse_layers(cfg):
        experts = ref[f"experts_b4_layer{i}"]
        for row in experts:
            assert len({tuple(pair) for pair in row}) >= 4, i
        assert set(np.unique(experts)) == set(range(cfg["num_experts"])), i  # every expert's weights count
