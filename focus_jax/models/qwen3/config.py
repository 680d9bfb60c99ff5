"""Qwen3-style dense decoders (SDAR, Qwen3): ``config.json`` <-> :class:`ModelConfig`, presets."""

from __future__ import annotations

from typing import Any

from focus_jax.config import ConfigError, ModelConfig

MODEL_TYPES = ("sdar", "qwen3")
SDAR_MASK_TOKEN_ID = 151669

GEOMETRIES: dict[str, dict[str, Any]] = {
    # Sizes of the public SDAR chat checkpoints, for benchmarks with random weights.
    "sdar-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                      num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True,
                      block_size=32, mask_token_id=SDAR_MASK_TOKEN_ID),
    "sdar-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                    num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False,
                    block_size=32, mask_token_id=SDAR_MASK_TOKEN_ID),
}


def require(raw: dict[str, Any], *fields: str) -> None:
    """A clear error naming the ``config.json`` fields that are missing."""
    missing = [key for key in fields if key not in raw]
    if missing:
        raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")


def rope_theta(raw: dict[str, Any]) -> float:
    """Plain RoPE's base frequency (any scaled variant is refused)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"rope type {rope_type!r} is not supported (only plain RoPE)")
    return float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0)))


def common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The :class:`ModelConfig` fields every Qwen3-style ``config.json`` states alike."""
    require(raw, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
    if raw.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported (SDAR and Qwen3 use none)")
    heads = raw["num_attention_heads"]
    return dict(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        block_size=raw.get("block_size"),
        mask_token_id=raw.get("mask_token_id"),
        model_type=raw["model_type"],
    )


def from_hf(raw: dict[str, Any], dtype: str) -> ModelConfig:
    """A dense ``config.json`` (``model_type`` ``sdar`` or ``qwen3``)."""
    return ModelConfig(**common_fields(raw), dtype=dtype)


def common_hf(cfg: ModelConfig, architecture: str) -> dict[str, Any]:
    """The ``config.json`` fields :func:`common_fields` reads."""
    out: dict[str, Any] = {
        "model_type": cfg.model_type,
        "architectures": [architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": cfg.dtype,
    }
    if cfg.block_size is not None:
        out["block_size"] = cfg.block_size
    if cfg.mask_token_id is not None:
        out["mask_token_id"] = cfg.mask_token_id
    return out


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` dictionary that :func:`from_hf` reads back."""
    return common_hf(cfg, "SDARForCausalLM" if cfg.model_type == "sdar" else "Qwen3ForCausalLM")
