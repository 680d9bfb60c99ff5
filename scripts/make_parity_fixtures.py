"""Regenerate the parity fixtures: tiny random Hugging Face checkpoints and their reference logits.

The reference is ``transformers``' own ``Qwen3ForCausalLM`` run in float32 with a 4-D additive
block-causal mask. The tests compare focus_jax's forward with these logits without needing torch.

    pip install -e '.[parity]'   # torch + transformers
    python scripts/make_parity_fixtures.py            # writes tests/fixtures/parity/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

CASES = {
    # name: (model_type written to config.json, tie_word_embeddings)
    "sdar_tied": ("sdar", True),
    "qwen3_untied": ("qwen3", False),
}
BLOCK_SIZES = (4, 8)
SEQ_LEN = 24
BATCH = 2


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

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, size=(BATCH, SEQ_LEN), dtype=np.int64)
    arrays = {"tokens": tokens.astype(np.int32)}
    with torch.no_grad():
        ids = torch.from_numpy(tokens)
        causal = model(input_ids=ids).logits.numpy()
        for block_size in BLOCK_SIZES:
            mask = block_causal_additive_mask(SEQ_LEN, block_size)
            logits = model(input_ids=ids, attention_mask=mask).logits.numpy()
            # The custom mask must have taken effect: inside a block, early positions see later ones.
            assert not np.allclose(logits, causal), "the 4-D mask was ignored"
            arrays[f"logits_b{block_size}"] = logits.astype(np.float32)
    np.savez_compressed(out / "reference_logits.npz", **arrays)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "tests/fixtures/parity")
    args = parser.parse_args()
    for seed, (name, (model_type, tied)) in enumerate(CASES.items()):
        make_case(args.out / name, model_type, tied, seed)


if __name__ == "__main__":
    main()
