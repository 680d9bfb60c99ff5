"""Tiny random LLaDA2 MoE checkpoints in the real Hugging Face layout (``model_type: llada2_moe``).

The layout (field names, weight names, torch ``Linear`` shapes ``[out, in]``) follows the public
checkpoints inclusionAI/LLaDA2.0-mini and LLaDA2.1-mini (config.json, model-*.safetensors) as read
by their remote ``modeling_llada2_moe.py`` and by SGLang's ``python/sglang/srt/models/llada2.py``;
see docs/notes/llada2_semantics.md. Nothing here is copied from either; the sizes are tiny and the
values random.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

# Token ids of the tiny checkpoint. The real config.json carries only ``pad_token_id`` (156892 for
# LLaDA2.0/2.1-mini); eos (156892) and mask (156895) come from the remote ``generate`` defaults,
# not from config.json, so the tiny checkpoint keeps them out of config.json too.
TINY_PAD_ID = 92
TINY_EOS_ID = 92
TINY_MASK_ID = 95

# Field names and ordering as in the real config.json of LLaDA2.1-mini (sizes shrunk). Note what the
# real file lacks: ``use_qk_norm`` (the config class defaults it to True), ``eos_token_id`` and
# ``mask_token_id``.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LLaDA2MoeModelLM"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
        "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
        "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
    },
    "dtype": "float32",
    "embedding_dropout": 0.0,
    "first_k_dense_replace": 1,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "max_position_embeddings": 512,
    "max_window_layers": 28,
    "model_type": "llada2_moe",
    "moe_intermediate_size": 32,
    "moe_router_enable_expert_bias": True,
    "n_group": 4,
    "norm_head": False,
    "norm_softmax": False,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "num_shared_experts": 1,
    "output_dropout": 0.0,
    "output_router_logits": False,
    "pad_token_id": TINY_PAD_ID,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 600000,
    "rotary_dim": 8,
    "routed_scaling_factor": 2.5,
    "router_dtype": "fp32",
    "score_function": "sigmoid",
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "topk_group": 2,
    "use_bias": False,
    "use_cache": False,
    "use_qkv_bias": False,
    "use_rmsnorm": True,
    "use_sliding_window": False,
    "using_split_qkv_in_self_attention": False,
    "vocab_size": 96,
}


def llada2_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight name of a LLaDA2 MoE checkpoint with its shape (torch ``Linear`` is ``[out, in]``).

    Biases appear only when the config asks for them: ``attention.query_key_value.bias`` with
    ``use_qkv_bias`` and ``attention.dense.bias`` with ``use_bias`` (remote ``LLaDA2MoeAttention``).
    ``lm_head.weight`` is absent when ``tie_word_embeddings`` is true.
    """
    h = config["hidden_size"]
    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // n_heads
    shapes: dict[str, tuple[int, ...]] = {"model.word_embeddings.weight": (config["vocab_size"], h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "attention.query_key_value.weight"] = ((n_heads + 2 * n_kv) * head_dim, h)
        if config.get("use_qkv_bias", False):
            shapes[p + "attention.query_key_value.bias"] = ((n_heads + 2 * n_kv) * head_dim,)
        if config.get("use_qk_norm", True):
            shapes[p + "attention.query_layernorm.weight"] = (head_dim,)
            shapes[p + "attention.key_layernorm.weight"] = (head_dim,)
        shapes[p + "attention.dense.weight"] = (h, n_heads * head_dim)
        if config.get("use_bias", False):
            shapes[p + "attention.dense.bias"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.get("num_experts") and layer >= config.get("first_k_dense_replace", 0):
            width = config["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (config["num_experts"], h)
            if config.get("moe_router_enable_expert_bias", False):
                shapes[p + "mlp.gate.expert_bias"] = (config["num_experts"],)
            for e in range(config["num_experts"]):
                _add_mlp(shapes, f"{p}mlp.experts.{e}.", h, width)
            if config.get("num_shared_experts"):
                _add_mlp(shapes, p + "mlp.shared_experts.", h, width * config["num_shared_experts"])
        else:
            _add_mlp(shapes, p + "mlp.", h, config["intermediate_size"])
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def _add_mlp(shapes: dict[str, tuple[int, ...]], prefix: str, hidden: int, width: int) -> None:
    """Adds the three SwiGLU projections under ``prefix`` (``gate_proj``, ``up_proj``, ``down_proj``)."""
    shapes[prefix + "gate_proj.weight"] = (width, hidden)
    shapes[prefix + "up_proj.weight"] = (width, hidden)
    shapes[prefix + "down_proj.weight"] = (hidden, width)


def _random_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator,
                   router_scale: float, bias_scale: float) -> np.ndarray:
    """One random float32 tensor, scaled by its role so activations stay of order one.

    Norm scales are ``1 + 0.5 * randn``; the router weight is scaled so its logits have standard
    deviation about ``router_scale`` (routing varies between tokens); the expert bias is
    ``bias_scale * randn``, comparable to the spread of the sigmoid scores, so it changes choices.
    """
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return (1.0 + 0.5 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("mlp.gate.expert_bias"):
        return (bias_scale * rng.standard_normal(shape)).astype(np.float32)
    if name == "model.word_embeddings.weight":
        return rng.standard_normal(shape).astype(np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = shape[-1]
    scale = router_scale if name.endswith("mlp.gate.weight") else 1.0
    return (scale * rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def write_tiny_llada2(folder: str | Path, seed: int = 0, *, router_scale: float = 2.0,
                      bias_scale: float = 0.3, **overrides: Any) -> dict[str, Any]:
    """Writes ``config.json`` and ``model.safetensors`` of a tiny random LLaDA2 MoE into ``folder``.

    ``overrides`` replace or add config.json fields (e.g. ``num_experts=8``, ``use_qk_norm=True``);
    ``router_scale`` and ``bias_scale`` set the spread of the router logits and of the expert bias.
    All tensors are float32 (the real checkpoints are bfloat16 with a float32 ``expert_bias``).
    Returns the config dict written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, **overrides}
    if "rotary_dim" not in overrides:  # keep the real file's redundant field consistent
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        config["rotary_dim"] = int(head_dim * config.get("partial_rotary_factor", 1.0))
    rng = np.random.default_rng(seed)
    tensors = {name: _random_tensor(name, shape, rng, router_scale, bias_scale)
               for name, shape in llada2_weight_shapes(config).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config
