"""LMDeploy's PyTorch engine on the SDAR-30B-A3B geometry with random weights, drawn on the GPU
while LMDeploy loads them: no 61 GB checkpoint is written (the GPU host has a 64 GiB disk).

  PYTHONPATH=/tmp/site python3 scripts/lmdeploy_random_moe.py --peer .peer --model-dir /tmp/a3b \\
      -- --batch 256 --max-new-tokens 256 --out lmdeploy_a3b.jsonl

``--peer``: the folder of the peer benchmark (``lmdeploy_bench.py``, ``make_random_sdar.py`` and
the SDAR tokenizer; ``../shared/peer`` copied into the checkout). Everything after ``--`` goes to
``lmdeploy_bench.py``, which runs the workload of ``focus-jax bench`` on LMDeploy (its docstring).

What this adds: ``--model-dir`` gets a ``config.json`` of ``model_type`` ``sdar_moe``
(``SDARMoeForCausalLM``, the sizes of :data:`GEOMETRY`: ours in
``focus_jax/models/qwen3_moe/config.py``), the dense SDAR ``generation_config.json`` and the
tokenizer; and LMDeploy's ``ModelWeightLoader`` yields Hugging Face-named tensors (the
Qwen3-MoE layout: ``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``) drawn on the GPU
(matrices N(0, 0.02^2) in bfloat16, norms 1, as ``make_random_sdar.py`` writes them) instead of
reading shard files. LMDeploy's own ``load_weights`` does the rest (fusing q/k/v and gate/up,
stacking the experts), as for a checkpoint on disk.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import shutil
import sys
from pathlib import Path

GEOMETRY = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=768)
"""SDAR-30B-A3B-Chat's sizes (the ``sdar-30b-a3b`` geometry of focus_jax)."""

STD = 0.02


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def moe_config(peer, block_size: int) -> dict:
    """The dense SDAR config of the peer script, turned into SDAR-MoE's."""
    cfg = peer.make_config("sdar-8b", block_size)
    cfg.update({k: v for k, v in GEOMETRY.items()})
    cfg.update(architectures=["SDARMoeForCausalLM"], model_type="sdar_moe", max_window_layers=48,
               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
               output_router_logits=False, router_aux_loss_coef=0.001)
    return cfg


def write_folder(peer, out: Path, tokenizer_src: Path, block_size: int) -> dict:
    """config.json, generation_config.json and the tokenizer files (no weights)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg = moe_config(peer, block_size)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(peer.GENERATION_CONFIG, indent=2))
    for f in peer.TOKENIZER_FILES:
        src = tokenizer_src / f
        if src.exists():
            shutil.copy2(src, out / f)
        else:
            (out / f).write_bytes(gzip.decompress((tokenizer_src / (f + ".gz")).read_bytes()))
    return cfg


def hf_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face Qwen3-MoE parameter names and shapes."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    e, w = cfg["num_experts"], cfg["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "self_attn.q_norm.weight", (d,)),
                (p + "self_attn.k_norm.weight", (d,)),
                (p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate.weight", (e, h))]
        for x in range(e):
            out += [(p + f"mlp.experts.{x}.gate_proj.weight", (w, h)),
                    (p + f"mlp.experts.{x}.up_proj.weight", (w, h)),
                    (p + f"mlp.experts.{x}.down_proj.weight", (h, w))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab_size"], h))]
    return out


def draw_weights_when_loading(cfg: dict, seed: int = 0) -> None:
    """LMDeploy's weight loader yields random tensors of ``cfg``'s names instead of reading
    files (one 'shard')."""
    import torch
    from lmdeploy.pytorch.weight_loader import model_weight_loader as loader

    def init(self, model_path: str, prefix: str | None = None) -> None:
        self.model_path, self._prefix = model_path, prefix
        self._weight_type, self._is_sharded = "safetensors", False
        self._shard_paths = ("random",)

    def weights(self, path: str):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for name, shape in hf_shapes(cfg):
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
            else:
                t = torch.randn(shape, generator=gen, dtype=torch.float32, device="cuda")
                t = t.mul_(STD).to(torch.bfloat16)
            yield (name if self._prefix is None else self._prefix + name), t

    loader.ModelWeightLoader.__init__ = init
    loader.ModelWeightLoader._get_weights_iterator = weights


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", type=Path, default=Path(".peer"))
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/a3b"))
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args(ours)
    peer = load_module(args.peer / "make_random_sdar.py", "make_random_sdar")
    cfg = write_folder(peer, args.model_dir, args.peer / "sdar_tokenizer", args.block_size)
    draw_weights_when_loading(cfg)
    bench = load_module(args.peer / "lmdeploy_bench.py", "lmdeploy_bench")
    sys.argv = ["lmdeploy_bench.py", "--model-dir", str(args.model_dir), *rest]
    bench.main()


if __name__ == "__main__":
    main()
