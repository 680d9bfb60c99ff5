"""Regenerate the parity fixtures: tiny random Hugging Face checkpoints and their reference logits.

The reference is ``transformers``' own ``Qwen3ForCausalLM`` (dense cases) or ``Qwen3MoeForCausalLM``
(MoE cases) run in float32 with a 4-D additive block-causal mask. The tests compare focus_jax's
forward with these logits without needing torch. Made with torch 2.13.0 and transformers 5.17.0.

    pip install -e '.[parity]'   # torch + transformers
    python scripts/make_parity_fixtures.py            # writes tests/fixtures/parity/
    python scripts/make_parity_fixtures.py --cases sdar_moe_tiny qwen3_moe_sparse_step   # only these

MoE checkpoints are written in the layout of the real Hugging Face checkpoints (Qwen3-30B-A3B,
SDAR-30B-A3B): one ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert and the router as
``mlp.gate.weight``. transformers 5 keeps experts fused in memory (``experts.gate_up_proj``
``[E, 2*I, H]``, ``experts.down_proj`` ``[E, H, I]``) but its ``save_pretrained`` writes them back
per expert; ``check_hub_layout`` asserts that it did. config.json gets the hub's ``num_experts``
key where transformers 5 writes ``num_local_experts``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

CASES = {
    # name: (model_type written to config.json, tie_word_embeddings)
    "sdar_tied": ("sdar", True),
    "qwen3_untied": ("qwen3", False),
}
MOE_CASES = {
    # name: (model_type, tie_word_embeddings, norm_topk_prob, num_hidden_layers, decoder_sparse_step,
    #        mlp_only_layers)
    # All layers sparse, like SDAR-30B-A3B (decoder_sparse_step 1, mlp_only_layers []).
    "sdar_moe_tiny": ("sdar_moe", False, True, 3, 1, []),
    # Dense and sparse layers mixed, each rule deciding one: layers 0 and 2 are dense through the step
    # ((i + 1) % 2 != 0), layer 3 through mlp_only_layers, so only layer 1 is sparse.
    "qwen3_moe_sparse_step": ("qwen3_moe", True, False, 4, 2, [3]),
}
BLOCK_SIZES = (4, 8)
SEQ_LEN = 24
BATCH = 2
ROUTER_SCALE = 0.5  # router weights ~6x the others: router logits of a few units, so routing varies
MIN_ROUTER_GAP = 1e-3  # k-th vs (k+1)-th router logit: no near-tie that float32 noise could flip


def block_causal_additive_mask(length: int, block_size: int) -> torch.Tensor:
    blocks = torch.arange(length) // block_size
    allowed = blocks[None, :] <= blocks[:, None]
    mask = torch.zeros(length, length)
    mask[~allowed] = torch.finfo(torch.float32).min
    return mask[None, None].expand(BATCH, 1, length, length)


def make_case(out: Path, model_type: str, tied: bool, seed: int) -> None:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=tied, attention_bias=False,
        rope_theta=10000.0,
    )
    model = Qwen3ForCausalLM(config).eval().float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # random norm scales, so that a missed norm shows
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.config._attn_implementation = "eager"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    raw = json.loads((out / "config.json").read_text())
    raw["model_type"] = model_type
    (out / "config.json").write_text(json.dumps(raw, indent=2))

    arrays, _ = reference_logits(model, config.vocab_size, seed)
    np.savez_compressed(out / "reference_logits.npz", **arrays)
    print(f"wrote {out}")


def reference_logits(model, vocab_size: int, seed: int) -> tuple[dict[str, np.ndarray], torch.Tensor]:
    """Random tokens (seeded) and the model's float32 logits under the block-causal mask of every
    block size, checked to differ from plain causal ones; and the token ids as a tensor."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=(BATCH, SEQ_LEN), dtype=np.int64)
    arrays = {"tokens": tokens.astype(np.int32)}
    ids = torch.from_numpy(tokens)
    with torch.no_grad():
        causal = model(input_ids=ids).logits.numpy()
        for block_size in BLOCK_SIZES:
            mask = block_causal_additive_mask(SEQ_LEN, block_size)
            logits = model(input_ids=ids, attention_mask=mask).logits.numpy()
            # The custom mask must have taken effect: inside a block, early positions see later ones.
            assert not np.allclose(logits, causal), "the 4-D mask was ignored"
            arrays[f"logits_b{block_size}"] = logits.astype(np.float32)
    return arrays, ids


def sparse_layers(config: Qwen3MoeConfig) -> list[int]:
    # Qwen3MoeDecoderLayer's rule for which layers get a sparse MoE block.
    return [i for i in range(config.num_hidden_layers)
            if i not in config.mlp_only_layers and config.num_experts > 0
            and (i + 1) % config.decoder_sparse_step == 0]


def check_hub_layout(out: Path, config: Qwen3MoeConfig) -> None:
    with safe_open(out / "model.safetensors", framework="np") as f:
        keys = set(f.keys())
    sparse = sparse_layers(config)
    for i in range(config.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp"
        if i in sparse:
            want = {f"{mlp}.gate.weight"} | {f"{mlp}.experts.{e}.{proj}.weight"
                                             for e in range(config.num_experts)
                                             for proj in ("gate_proj", "up_proj", "down_proj")}
        else:
            want = {f"{mlp}.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")}
        got = {k for k in keys if k.startswith(mlp + ".")}
        assert got == want, f"layer {i}: saved {sorted(got - want)}, missing {sorted(want - got)}"


def make_moe_case(out: Path, model_type: str, tied: bool, norm_topk: bool, layers: int,
                  sparse_step: int, mlp_only: list[int], seed: int) -> None:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk,
        decoder_sparse_step=sparse_step, mlp_only_layers=mlp_only, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=tied, attention_bias=False,
        rope_theta=10000.0,
    )
    model = Qwen3MoeForCausalLM(config).eval().float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # random norm scales, so that a missed norm shows
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(ROUTER_SCALE * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.config._attn_implementation = "eager"
    model.set_experts_implementation("eager")  # the plain per-expert loop
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    check_hub_layout(out, config)
    raw = json.loads((out / "config.json").read_text())
    raw["model_type"] = model_type
    raw["num_experts"] = raw.pop("num_local_experts")
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True))

    sparse = sparse_layers(config)
    assert sparse == [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse, "no sparse layer"
    chosen: dict[int, torch.Tensor] = {}

    def record(layer: int):
        def hook(module, args, output):
            router_logits, _, indices = output  # Qwen3MoeTopKRouter: (logits, top-k weights, top-k indices)
            # transformers' routing: softmax in float32, then top-k; recomputed here as a check.
            probs = torch.softmax(router_logits.float(), dim=-1)
            assert torch.equal(torch.topk(probs, config.num_experts_per_tok, dim=-1).indices, indices)
            top = torch.sort(router_logits, dim=-1, descending=True).values
            gap = (top[:, config.num_experts_per_tok - 1] - top[:, config.num_experts_per_tok]).min()
            assert gap > MIN_ROUTER_GAP, f"layer {layer}: near-tie in the router ({gap:.2e})"
            chosen[layer] = indices
        return hook

    for i in sparse:
        model.model.layers[i].mlp.gate.register_forward_hook(record(i))

    # The hooks record the last forward's choices: the block-size-4 one is run again last.
    arrays, ids = reference_logits(model, config.vocab_size, seed)
    arrays["sparse_layers"] = np.asarray(sparse, dtype=np.int32)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=block_causal_additive_mask(SEQ_LEN, 4))
        for i in sparse:
            experts = np.sort(chosen[i].numpy().reshape(BATCH, SEQ_LEN, -1), axis=-1).astype(np.int32)
            # Routing must vary: across the tokens of each row, and over the whole expert set.
            for row in experts:
                assert len({tuple(e) for e in row}) >= 4, f"layer {i}: routing barely varies"
            assert set(np.unique(experts)) == set(range(config.num_experts)), f"layer {i}: idle experts"
            arrays[f"experts_b4_layer{i}"] = experts

        # The written checkpoint (per-expert tensors, renamed config key) must reproduce the reference.
        reloaded = Qwen3MoeForCausalLM.from_pretrained(
            out, config=Qwen3MoeConfig.from_dict({**raw, "model_type": "qwen3_moe"})).eval()
        reloaded.config._attn_implementation = "eager"
        reloaded.set_experts_implementation("eager")
        again = reloaded(input_ids=ids, attention_mask=block_causal_additive_mask(SEQ_LEN, 4)).logits
        assert np.array_equal(again.numpy(), arrays["logits_b4"]), "the saved checkpoint differs"
    np.savez_compressed(out / "reference_logits.npz", **arrays)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "tests/fixtures/parity")
    parser.add_argument("--cases", nargs="+", choices=[*CASES, *MOE_CASES],
                        help="write only these cases (default: all)")
    args = parser.parse_args()
    wanted = set(args.cases or [*CASES, *MOE_CASES])
    for seed, (name, (model_type, tied)) in enumerate(CASES.items()):
        if name in wanted:
            make_case(args.out / name, model_type, tied, seed)
    for seed, (name, spec) in enumerate(MOE_CASES.items(), start=len(CASES)):
        if name in wanted:
            make_moe_case(args.out / name, *spec, seed)


if __name__ == "__main__":
    main()
