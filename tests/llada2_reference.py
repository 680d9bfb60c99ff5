"""An independent NumPy forward of the LLaDA2 MoE family (``model_type: llada2_moe``).

Written from reading the public modeling code, never running it:

* HF   = inclusionAI/LLaDA2.0-mini ``modeling_llada2_moe.py`` (the same text ships with LLaDA2.1-mini
         and is mirrored in github inclusionAI/dFactory ``models/llada2_moe/modeling_llada2_moe.py``);
* SGL  = github sgl-project/sglang ``python/sglang/srt/models/llada2.py`` and, for the router,
         ``python/sglang/srt/layers/moe/topk.py``;
* BAIL = the Ling/Bailing MoE v2 modeling it derives from (github inclusionAI/Ming
         ``modeling_bailing_moe_v2.py``, ``BailingMoeV2Gate``), whose router is the same.

Each semantic below names its source. Everything is computed in ``dtype`` (float64 by default; the
HF code runs the router and the norms in float32 and the rest in bfloat16). docs/notes/
llada2_semantics.md lists the choices where the sources differ or are silent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

Weights = dict[str, np.ndarray]


def load_llada2(folder: str | Path) -> tuple[dict[str, Any], Weights]:
    """The config dict and every tensor of a checkpoint folder (config.json + all *.safetensors)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "llada2_moe":
        raise ValueError(f"not a llada2_moe checkpoint: {config.get('model_type')!r}")
    weights: Weights = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    return config, weights


def block_causal_mask(length: int, block: int) -> np.ndarray:
    """Boolean ``[length, length]``: query i sees key j iff ``j // block <= i // block``.

    Source: HF ``LLaDA2MoeModelLM.generate`` (a lower-triangular block matrix expanded by
    ``repeat_interleave(block_length)`` on both axes, turned into 0 / -inf by ``.log()``).
    """
    blocks = np.arange(length) // block
    return blocks[None, :] <= blocks[:, None]


def rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, then the learned scale.

    Source: HF ``LLaDA2MoeRMSNorm.forward`` (mean of squares in float32, ``x * rsqrt(var + eps)``,
    cast back to the input dtype, then ``weight *``); no mean subtraction, no bias.
    """
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return scale * (x / np.sqrt(variance + eps))


def rotary_dim(config: dict[str, Any]) -> int:
    """How many leading dims of each head RoPE rotates.

    Source: HF ``LLaDA2MoeAttention.__init__`` and transformers' default rope init
    (``int(head_dim * partial_rotary_factor)``); SGL ``LLaDA2MoeAttention.__init__`` prefers
    ``partial_rotary_factor`` and falls back to ``rotary_dim``, then to ``head_dim``.
    """
    head_dim = _head_dim(config)
    if "partial_rotary_factor" in config:
        return int(head_dim * config["partial_rotary_factor"])
    return int(config.get("rotary_dim") or head_dim)


def apply_rope(x: np.ndarray, positions: np.ndarray, rot_dim: int, theta: float) -> np.ndarray:
    """Rotates the first ``rot_dim`` dims of every head of ``x`` ``[b, t, heads, head_dim]``.

    Source: HF ``LLaDA2MoeRotaryEmbedding.forward`` (``inv_freq = theta ** -(arange(0, d, 2) / d)``
    with d = rot_dim, angles ``pos * inv_freq`` duplicated as ``cat(freqs, freqs)``) and HF
    ``apply_rotary_pos_emb`` / ``rotate_half``: the "half-split" (NeoX) layout inside the rotated
    slice, i.e. dim i pairs with dim i + rot_dim/2; dims ``rot_dim:`` pass through unchanged.
    """
    half = rot_dim // 2
    inv_freq = theta ** -(np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    angles = positions[..., None].astype(np.float64) * inv_freq  # [b, t, half]
    cos = np.cos(np.concatenate([angles, angles], axis=-1))[:, :, None, :].astype(x.dtype)
    sin = np.sin(np.concatenate([angles, angles], axis=-1))[:, :, None, :].astype(x.dtype)
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    rotated_half = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return np.concatenate([rot * cos + rotated_half * sin, rest], axis=-1)


def _head_dim(config: dict[str, Any]) -> int:
    """``head_dim``, defaulting to ``hidden_size // num_attention_heads`` (HF config class)."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _linear(x: np.ndarray, weights: Weights, name: str) -> np.ndarray:
    """``x @ W.T (+ b)`` for a torch ``Linear`` stored as ``name.weight`` ``[out, in]`` (+ ``name.bias``)."""
    y = x @ weights[name + ".weight"].T
    bias = weights.get(name + ".bias")
    return y if bias is None else y + bias


def attention(config: dict[str, Any], weights: Weights, prefix: str, x: np.ndarray,
              positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Self-attention of one layer on the normed input ``x`` ``[b, t, hidden]``.

    Source: HF ``LLaDA2MoeAttention.forward`` + ``eager_attention_forward``:
    * fused ``query_key_value`` output viewed as ``[.., heads + 2 * kv_heads, head_dim]`` and split
      by heads into (heads, kv_heads, kv_heads): rows ``[0, H*d)`` are Q, the next ``KV*d`` are K,
      the last ``KV*d`` are V, each head a contiguous ``head_dim`` run;
    * per-head RMSNorm ``query_layernorm`` / ``key_layernorm`` over ``head_dim`` BEFORE RoPE (when
      ``use_qk_norm``, which the config class and SGL default to True; the real config.json omits it);
    * GQA: query head h reads kv head ``h // (heads // kv_heads)`` (``repeat_kv``);
    * scale ``head_dim ** -0.5``, additive mask (here: False -> -inf), softmax over keys,
      not causal (``is_causal = False``): only the given mask restricts attention;
    * output projection ``dense`` (bias iff ``use_bias``; QKV bias iff ``use_qkv_bias``).
    """
    b, t, _ = x.shape
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = _head_dim(config)
    qkv = _linear(x, weights, prefix + "query_key_value").reshape(b, t, n_heads + 2 * n_kv, head_dim)
    q, k, v = qkv[:, :, :n_heads], qkv[:, :, n_heads:n_heads + n_kv], qkv[:, :, n_heads + n_kv:]
    if config.get("use_qk_norm", True):
        eps = config["rms_norm_eps"]
        q = rms_norm(q, weights[prefix + "query_layernorm.weight"], eps)
        k = rms_norm(k, weights[prefix + "key_layernorm.weight"], eps)
    rot, theta = rotary_dim(config), float(config["rope_theta"])
    q, k = apply_rope(q, positions, rot, theta), apply_rope(k, positions, rot, theta)
    group = n_heads // n_kv
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # kv head j -> heads j*g..j*g+g-1
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
    scores = np.where(mask[None, None], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs = probs / probs.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, n_heads * head_dim)
    return _linear(out, weights, prefix + "dense")


def swiglu(weights: Weights, prefix: str, x: np.ndarray) -> np.ndarray:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Source: HF ``LLaDA2MoeMLP.forward`` (``hidden_act`` is "silu"; HF has no MLP biases, SGL adds
    them iff ``use_bias``, which the real checkpoints set False).
    """
    gate = _linear(x, weights, prefix + "gate_proj")
    up = _linear(x, weights, prefix + "up_proj")
    return _linear(gate / (1.0 + np.exp(-gate)) * up, weights, prefix + "down_proj")


def route(config: dict[str, Any], x: np.ndarray, gate_weight: np.ndarray,
          expert_bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Experts chosen for each row of ``x`` ``[n, hidden]`` and their weights, both ``[n, top_k]``.

    Sources: HF ``LLaDA2MoeGate.forward`` / ``group_limited_topk`` (= BAIL ``BailingMoeV2Gate``),
    SGL ``biased_grouped_topk_impl``:
    1. router logits ``x @ gate.weight.T`` in float32 (HF casts both to float32; here ``dtype``);
    2. scores ``sigmoid(logits)`` (``score_function: sigmoid``);
    3. choice scores = scores + ``expert_bias`` (the bias only steers the CHOICE);
    4. experts split into ``n_group`` contiguous groups; a group's score is the sum of its two
       largest choice scores; the ``topk_group`` best groups are kept, the others set to -inf;
    5. the ``num_experts_per_tok`` largest choice scores among kept experts are chosen;
    6. weights are the UNBIASED sigmoid scores of the chosen experts, divided by their sum + 1e-20
       (HF: whenever top_k > 1; SGL: iff ``norm_topk_prob``; here: iff both), then multiplied by
       ``routed_scaling_factor`` (HF and SGL apply it in every case).
    The ids are returned sorted ascending per row (the weights follow them).
    """
    if config.get("score_function", "sigmoid") != "sigmoid":
        raise NotImplementedError("only the sigmoid router of the released LLaDA2 checkpoints")
    n_experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    n_group, topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
    scores = 1.0 / (1.0 + np.exp(-(x @ gate_weight.T)))
    choice = scores if expert_bias is None else scores + expert_bias
    if n_group > 1:
        grouped = choice.reshape(len(x), n_group, n_experts // n_group)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        kept_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
        kept = np.zeros((len(x), n_group), dtype=bool)
        np.put_along_axis(kept, kept_groups, True, axis=-1)
        choice = np.where(np.repeat(kept, n_experts // n_group, axis=-1), choice, -np.inf)
    ids = np.sort(np.argsort(-choice, axis=-1, kind="stable")[:, :top_k], axis=-1)
    chosen = np.take_along_axis(scores, ids, axis=-1)
    if top_k > 1 and config.get("norm_topk_prob", True):
        chosen = chosen / (chosen.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, chosen * config.get("routed_scaling_factor", 1.0)


def moe(config: dict[str, Any], weights: Weights, prefix: str,
        x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Routed experts plus shared expert(s) on the normed input ``x`` ``[b, t, hidden]``.

    Source: HF ``LLaDA2MoeSparseMoeBlock`` (``forward`` / ``moe_infer``): each token's output is
    ``sum_k weight_k * expert_{id_k}(x)`` plus ``shared_experts(x)``, one SwiGLU MLP of width
    ``moe_intermediate_size * num_shared_experts`` (SGL: present iff ``num_shared_experts > 0``).
    Returns the output and the chosen ids ``[b, t, top_k]``.
    """
    b, t, h = x.shape
    flat = x.reshape(b * t, h)
    ids, mix = route(config, flat, weights[prefix + "gate.weight"], weights.get(prefix + "gate.expert_bias"))
    out = np.zeros_like(flat)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        out[rows] += mix[rows, slot, None] * swiglu(weights, f"{prefix}experts.{e}.", flat[rows])
    if config.get("num_shared_experts"):
        out = out + swiglu(weights, prefix + "shared_experts.", flat)
    return out.reshape(b, t, h), ids.reshape(b, t, -1)


def llada2_forward(config: dict[str, Any], weights: Weights, token_ids: np.ndarray, mask: np.ndarray,
                   *, positions: np.ndarray | None = None, dtype: type = np.float64,
                   record: dict[int, np.ndarray] | None = None
                   ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Logits ``[b, t, vocab]`` and, per MoE layer index, the chosen expert ids ``[b, t, top_k]``.

    ``token_ids`` is ``[b, t]``; ``mask`` is boolean ``[t, t]``, True where query i sees key j;
    ``positions`` ``[b, t]`` defaults to ``0..t-1`` (HF ``generate`` passes ``arange``). If
    ``record`` is given, it receives each MoE layer's router input (the post-attention-normed
    hidden states, ``[b, t, hidden]``).

    Source: HF ``LLaDA2MoeModel.forward``, ``LLaDA2MoeDecoderLayer.forward``, ``LLaDA2MoeModelLM``:
    ``word_embeddings`` lookup (no scaling); per layer a pre-norm residual block
    ``x += attention(input_layernorm(x))``, ``x += mlp(post_attention_layernorm(x))``, where the
    mlp is a dense SwiGLU of width ``intermediate_size`` for layer < ``first_k_dense_replace`` and
    the MoE block after; final ``model.norm``; ``lm_head`` (the embedding when
    ``tie_word_embeddings``; ``norm_head`` is not supported: SGL ``load_weights`` would normalize it).
    """
    if config.get("norm_head"):
        raise NotImplementedError("norm_head")
    if config.get("rope_scaling") not in (None, {}) and config["rope_scaling"].get(
            "rope_type", config["rope_scaling"].get("type")) != "default":
        raise NotImplementedError("rope_scaling")
    w = {name: value.astype(dtype) for name, value in weights.items()}
    b, t = token_ids.shape
    if positions is None:
        positions = np.broadcast_to(np.arange(t), (b, t))
    eps = config["rms_norm_eps"]
    x = w["model.word_embeddings.weight"][token_ids]
    routes: dict[int, np.ndarray] = {}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        x = x + attention(config, w, p + "attention.", rms_norm(x, w[p + "input_layernorm.weight"], eps),
                          positions, mask)
        normed = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if config.get("num_experts") and layer >= config.get("first_k_dense_replace", 0):
            if record is not None:
                record[layer] = normed
            update, routes[layer] = moe(config, w, p + "mlp.", normed)
        else:
            update = swiglu(w, p + "mlp.", normed)
        x = x + update
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.word_embeddings.weight"] if config.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T, routes


def llada2_reference(folder: str | Path, token_ids: np.ndarray, mask: np.ndarray, *,
                     positions: np.ndarray | None = None, dtype: type = np.float64
                     ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """``llada2_forward`` on the checkpoint in ``folder``: (logits ``[b, t, vocab]``, routes)."""
    config, weights = load_llada2(folder)
    return llada2_forward(config, weights, np.asarray(token_ids), np.asarray(mask, dtype=bool),
                          positions=positions, dtype=dtype)
