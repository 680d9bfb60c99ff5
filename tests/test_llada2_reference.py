"""Checks of the NumPy LLaDA2 reference itself and of the tiny checkpoint it is run on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.llada2_checkpoint import TINY_MASK_ID, llada2_weight_shapes, write_tiny_llada2
from tests.llada2_reference import (
    apply_rope,
    block_causal_mask,
    llada2_forward,
    load_llada2,
    route,
)

BLOCK = 4
LENGTH = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The default tiny checkpoint, written once and loaded back through the reference's loader."""
    folder = tmp_path_factory.mktemp("llada2")
    write_tiny_llada2(folder, seed=0)
    return load_llada2(folder)


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    """Two random sequences with a few mask tokens, ``[2, LENGTH]``."""
    ids = np.random.default_rng(1).integers(0, 90, size=(2, LENGTH))
    ids[:, -3:] = TINY_MASK_ID
    return ids


def test_checkpoint_layout_is_the_real_one(tmp_path: Path) -> None:
    """Weight names, shapes and dtypes follow the HF layout; the first layer is dense."""
    config = write_tiny_llada2(tmp_path, seed=3)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == llada2_weight_shapes(config)
    assert tensors["model.layers.0.attention.query_key_value.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert "model.layers.0.mlp.gate_proj.weight" in tensors
    assert tensors["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.2.mlp.experts.15.down_proj.weight"].shape == (64, 32)
    assert all(v.dtype == np.float32 for v in tensors.values())
    assert config["model_type"] == "llada2_moe" and config["architectures"] == ["LLaDA2MoeModelLM"]
    assert "use_qk_norm" not in config and config["rotary_dim"] == 8


def test_routing_varies_between_tokens(tiny, tokens) -> None:
    """Every MoE layer sends different tokens to different expert sets."""
    config, weights = tiny
    _, routes = llada2_forward(config, weights, tokens, block_causal_mask(LENGTH, BLOCK))
    assert sorted(routes) == [1, 2]
    for ids in routes.values():
        assert ids.shape == (2, LENGTH, config["num_experts_per_tok"])
        assert np.all(np.diff(ids, axis=-1) > 0)  # sorted, distinct
        assert len({tuple(row) for row in ids.reshape(-1, ids.shape[-1])}) >= 6


def test_expert_bias_changes_the_choice(tiny, tokens) -> None:
    """Zeroing ``expert_bias`` changes the chosen experts of some token, hence the logits."""
    config, weights = tiny
    mask = block_causal_mask(LENGTH, BLOCK)
    logits, routes = llada2_forward(config, weights, tokens, mask)
    unbiased = {k: (np.zeros_like(v) if k.endswith("expert_bias") else v) for k, v in weights.items()}
    logits0, routes0 = llada2_forward(config, unbiased, tokens, mask)
    assert any(np.any(routes[layer] != routes0[layer]) for layer in routes)
    assert not np.allclose(logits, logits0)


def _brute_force_choice(config: dict[str, Any], x: np.ndarray, gate: np.ndarray,
                        bias: np.ndarray, groups: bool = True) -> tuple[list[set[int]], list[set[int]]]:
    """Chosen experts and allowed experts per row, by plain Python loops over the definition."""
    per_group = config["num_experts"] // config["n_group"]
    chosen, allowed = [], []
    for row in x:
        biased = [1 / (1 + np.exp(-float(row @ gate[e]))) + float(bias[e]) for e in range(len(gate))]
        group_score = {g: sum(sorted(biased[g * per_group:(g + 1) * per_group])[-2:])
                       for g in range(config["n_group"])}
        kept = sorted(group_score, key=lambda g: -group_score[g])[:config["topk_group"]]
        ok = {e for e in range(len(gate)) if e // per_group in kept} if groups else set(range(len(gate)))
        allowed.append(ok)
        chosen.append(set(sorted(ok, key=lambda e: -biased[e])[:config["num_experts_per_tok"]]))
    return chosen, allowed


def test_group_limited_selection_matches_brute_force(tiny, tokens) -> None:
    """The reference's choice equals a loop-by-loop computation, stays inside the kept groups, and
    the group limit, the expert bias and the top-2 group score each matter for some token."""
    config, weights = tiny
    record: dict[int, np.ndarray] = {}
    _, routes = llada2_forward(config, weights, tokens, block_causal_mask(LENGTH, BLOCK), record=record)
    group_limited = top2_vs_max = False
    for layer, ids in routes.items():
        x = record[layer].reshape(-1, config["hidden_size"])
        gate = weights[f"model.layers.{layer}.mlp.gate.weight"].astype(np.float64)
        bias = weights[f"model.layers.{layer}.mlp.gate.expert_bias"].astype(np.float64)
        chosen, allowed = _brute_force_choice(config, x, gate, bias)
        free, _ = _brute_force_choice(config, x, gate, bias, groups=False)
        for row, (want, ok, unlimited) in enumerate(zip(chosen, allowed, free, strict=True)):
            got = set(ids.reshape(-1, ids.shape[-1])[row].tolist())
            assert got == want and got <= ok
            group_limited |= unlimited != want
        grouped = (1 / (1 + np.exp(-(x @ gate.T))) + bias).reshape(len(x), config["n_group"], -1)
        k = config["topk_group"]
        by_max = np.argsort(-grouped.max(-1), axis=-1)[:, :k]
        by_top2 = np.argsort(-np.sort(grouped, -1)[..., -2:].sum(-1), axis=-1)[:, :k]
        top2_vs_max |= any(set(a) != set(b) for a, b in zip(by_max, by_top2, strict=True))
    assert group_limited, "the tiny checkpoint never exercises the group limit"
    assert top2_vs_max, "the tiny checkpoint cannot tell top-2-sum group scores from max"


def test_route_weights_use_unbiased_scores() -> None:
    """Weights are the unbiased sigmoid scores, renormalized, times routed_scaling_factor."""
    config = {"num_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
              "norm_topk_prob": True, "routed_scaling_factor": 2.5}
    x = np.array([[1.0, 0.0]])
    gate = np.array([[2.0, 0.0], [1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]])
    ids, mix = route(config, x, gate, np.array([0.0, 0.0, 0.0, 5.0]))
    assert ids.tolist() == [[0, 3]]  # the bias pulls expert 3 in
    s = 1 / (1 + np.exp(-np.array([2.0, -1.0])))
    np.testing.assert_allclose(mix, [2.5 * s / s.sum()])


def test_partial_rope_is_relative_and_leaves_the_tail() -> None:
    """RoPE rotates only the first ``rot_dim`` dims, and q.k depends only on the position offset."""
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((2, 1, 1, 1, 16))
    def dot(pq: int, pk: int) -> float:
        """q at position pq dotted with k at position pk."""
        return float(np.sum(apply_rope(q, np.array([[pq]]), 8, 600000.0)
                            * apply_rope(k, np.array([[pk]]), 8, 600000.0)))
    np.testing.assert_allclose(dot(7, 3), dot(107, 103), rtol=1e-10)
    assert not np.isclose(dot(7, 3), dot(3, 7))
    moved = apply_rope(q, np.array([[9]]), 8, 10.0)
    np.testing.assert_array_equal(moved[..., 8:], q[..., 8:])
    assert not np.allclose(moved[..., :8], q[..., :8])


def test_block_causal_mask_matters(tiny, tokens) -> None:
    """An early position of a block sees later tokens of its own block, never a later block."""
    config, weights = tiny
    mask = block_causal_mask(LENGTH, BLOCK)
    assert mask[0, BLOCK - 1] and not mask[BLOCK - 1, BLOCK] and mask[BLOCK, 0]
    logits, _ = llada2_forward(config, weights, tokens, mask)
    same_block = tokens.copy()
    same_block[:, 2] = (same_block[:, 2] + 1) % 90
    changed, _ = llada2_forward(config, weights, same_block, mask)
    assert np.abs(changed[:, 0] - logits[:, 0]).max() > 1e-3
    later_block = tokens.copy()
    later_block[:, BLOCK + 1] = (later_block[:, BLOCK + 1] + 1) % 90
    unchanged, _ = llada2_forward(config, weights, later_block, mask)
    np.testing.assert_allclose(unchanged[:, :BLOCK], logits[:, :BLOCK], rtol=0, atol=1e-12)
    assert np.abs(unchanged[:, BLOCK:] - logits[:, BLOCK:]).max() > 1e-3
    full, _ = llada2_forward(config, weights, tokens, np.ones((LENGTH, LENGTH), dtype=bool))
    assert np.abs(full[:, 0] - logits[:, 0]).max() > 1e-3
