"""Configurations: the model's geometry (read from a Hugging Face ``config.json``) and generation.

Both are frozen dataclasses validated on construction, so a bad value fails at the call that made
it, with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

SUPPORTED_BLOCK_SIZES = (4, 8, 16, 32, 64)
MODES = ("baseline", "delayed", "focus")
KV_LAYOUTS = ("contiguous", "paged")
UNMASKING_RULES = ("low_confidence_dynamic", "low_confidence_static", "sequential")
DEFAULT_THRESHOLD = {"baseline": 0.9, "delayed": 0.9, "focus": 0.8}
# Compaction buckets (fractions of slots x block): steps of 1/32 up to 1/4, of 1/16 up to 1/2,
# then of 1/8. FOCUS typically retains a fifth to a quarter of a block's tokens and processes
# about half, so the fine steps sit where they save the most; 16 buckets, 16 compiled branches.
DEFAULT_LADDER = (tuple(k / 32 for k in range(1, 8)) + tuple(k / 16 for k in range(4, 8))
                  + tuple(k / 8 for k in range(4, 9)))
# On CPUs compiling the decode round dominates a short run, and padding costs little there: on 2
# cores the bundled model's round at 64 slots compiles in 45.6 / 20.8 / 14.3 / 9.4 CPU-seconds
# with 16 / 8 / 4 / 2 buckets and decodes 64 held-out questions in 16.5 / 16.9 / 16.9 / 22.4
# (docs/startup.md).
CPU_LADDER = (0.25, 0.5, 0.75, 1.0)
# On GPUs two finer buckets below 1/32 (64 and 128 rows at 256 slots): a lightly loaded server's
# step (8 requests in 256 slots) retains fewer rows than the 1/32 bucket's 256. On an H200 at
# SDAR-8B, 2 requests/s: time between blocks 0.445 -> 0.419 s, first block p50 0.314 -> 0.300 s;
# the server at saturation 3207.8 tok/s against 3210.5 (docs/serving.md, "Re-measured").
GPU_LADDER = (1 / 128, 1 / 64, *DEFAULT_LADDER)
# The processed rows (layers 0-1 and the eviction) on GPUs: 9 rungs of their own. They run 2 of a
# model's layers (SDAR-8B: 2 of 36), so coarser rungs pad little work, and each rung is a branch
# of three switches of the round to compile. Kept: the rungs where a loaded server's processed
# rows land (about half the full bucket) and a few small ones for a light load. SDAR-8B, 256
# slots, on an H100: the round compiles in 80.5 s against 102.8 s (CPU 157 s against 212), and
# focus at batch 128 steps in 36.87 ms against 36.89 (docs/startup.md, "The processed rows'
# own ladder, measured on a GPU").
GPU_PROCESSED_LADDER = (1 / 128, 1 / 32, 1 / 8, 1 / 4, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1.0)
GPU_MIN_BUCKET = 16
"""No compaction bucket of fewer rows on GPUs: a GEMM of fewer rows reads the same weights in
about the same time, and a bucket of one row turned each layer's products into XLA's dot
strength reduction (an elementwise multiply the size of the weight matrix, then a reduction)
instead of a GEMM that reads the weights in place (``tests/test_compilation.py``,
``test_gpu_layer_loop_reads_weights_in_place``, at 8 slots x block 8, where the 1/128 rung is
one row). At 256 slots x block 32 the smallest bucket is 64 rows either way."""

Mode = Literal["baseline", "delayed", "focus"]
KVLayout = Literal["contiguous", "paged"]
UnmaskingRule = Literal["low_confidence_dynamic", "low_confidence_static", "sequential"]


def mode_label(mode: str, commit_refresh: bool) -> str:
    """A mode as reports name it: ``+ refresh`` where blocks are refreshed at their commit
    (``baseline`` rewrites its block's KV every step: the option changes nothing there)."""
    return f"{mode} + refresh" if commit_refresh and mode != "baseline" else mode


class ConfigError(ValueError):
    """A configuration value that focus_jax cannot use; the message says what to change."""


def _dtype(name: str) -> Any:
    try:
        return {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not supported: use 'bfloat16' or 'float32'") from None


ROUTER_SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The mixture of experts of a sparse decoder: which layers route, and how.

    Each token's router scores every expert (``softmax`` or ``sigmoid`` over float32 logits),
    picks ``experts_per_token`` of them (with ``num_groups > 1``: only among the experts of the
    ``groups_per_token`` groups whose two best scores sum highest; with ``expert_bias``: a learnt
    per-expert bias added for choosing only) and sums their SwiGLU outputs weighted by their
    scores (normalised to sum 1 with ``norm_topk_prob``, then times ``routed_scaling_factor``),
    plus a shared expert of width ``shared_expert_size`` that every token runs (0: none).
    """

    num_experts: int
    experts_per_token: int
    expert_size: int
    """Each expert's SwiGLU width (``moe_intermediate_size``)."""
    dense_layers: tuple[int, ...] = ()
    """Layers with a dense MLP of ``intermediate_size`` instead of experts."""
    scores: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    groups_per_token: int = 1
    expert_bias: bool = False
    shared_expert_size: int = 0

    def __post_init__(self) -> None:
        for name, hf in (("num_experts", "num_experts"), ("experts_per_token", "num_experts_per_tok"),
                         ("expert_size", "moe_intermediate_size"), ("num_groups", "n_group"),
                         ("groups_per_token", "topk_group")):
            value = getattr(self, name)
            if not is_integer(value) or value <= 0:
                raise ConfigError(f"{hf} must be a positive integer, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.experts_per_token}) exceeds num_experts "
                              f"({self.num_experts})")
        if self.scores not in ROUTER_SCORES:
            raise ConfigError(f"score_function {self.scores!r} is not supported; supported: "
                              f"{', '.join(ROUTER_SCORES)}")
        if self.num_experts % self.num_groups:
            raise ConfigError(f"num_experts ({self.num_experts}) does not divide into n_group "
                              f"({self.num_groups}) groups")
        if self.groups_per_token > self.num_groups:
            raise ConfigError(f"topk_group ({self.groups_per_token}) exceeds n_group "
                              f"({self.num_groups})")
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and per_group < 2:
            raise ConfigError(f"n_group {self.num_groups} leaves {per_group} expert per group; a "
                              f"group is scored by its two best experts")
        if self.experts_per_token > self.groups_per_token * per_group:
            raise ConfigError(f"num_experts_per_tok ({self.experts_per_token}) exceeds the "
                              f"{self.groups_per_token * per_group} experts of topk_group "
                              f"({self.groups_per_token}) groups")
        if not is_integer(self.shared_expert_size) or self.shared_expert_size < 0:
            raise ConfigError(f"the shared expert's width must be an integer >= 0, got "
                              f"{self.shared_expert_size!r}")
        if not _is_finite(self.routed_scaling_factor) or self.routed_scaling_factor <= 0:
            raise ConfigError(f"routed_scaling_factor must be a positive number, got "
                              f"{self.routed_scaling_factor!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))


QUANTIZED_TYPES = ("int8", "fp8")
"""Weight types of quantized models: int8 (symmetric) and FP8 (e4m3), each with a scale per
output channel."""
QUANT_METHOD = "focus_jax"
"""``quant_method`` in the ``quantization_config`` of a folder focus_jax quantized."""
FP8_CHECKPOINT_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
"""``quant_method`` of Hugging Face folders with FP8 weights and their scales (Qwen's and
DeepSeek's ``fp8`` releases with a scale per block, FBGEMM's and compressed-tensors'
``float-quantized`` format with one per channel or tensor): their weights load dequantized into
the model's dtype (``models.weights.checkpoint_tensors``); ``quantize="fp8"`` makes them 8-bit
again, per output channel."""


def is_fp8_checkpoint(raw: Any) -> bool:
    """Whether a ``quantization_config`` describes a Hugging Face folder of FP8 weights that
    focus_jax dequantizes as it loads."""
    if not isinstance(raw, dict) or raw.get("quant_method") not in FP8_CHECKPOINT_METHODS:
        return False
    return raw["quant_method"] != "compressed-tensors" or raw.get("format") == "float-quantized"


@dataclasses.dataclass(frozen=True)
class Quantization:
    """8-bit weights for the projections and the experts (embedding, LM head, norms and router
    stay in the model's dtype; the KV cache too).

    ``weights``: ``int8`` or ``fp8``, quantized per output channel (one scale per output feature,
    per layer and per expert). ``activations_from``: also quantize the activations, per token and
    dynamically, to the weights' type in every projection of at least that many rows (a bucket of
    the compaction ladder), so that the product runs on 8-bit tensor cores; ``None``: weights
    only, dequantized in the matmul. The experts always run weights only.
    """

    weights: str
    activations_from: int | None = None

    def __post_init__(self) -> None:
        if self.weights not in QUANTIZED_TYPES:
            raise ConfigError(f"quantize {self.weights!r} is not supported; choose from "
                              f"{', '.join(QUANTIZED_TYPES)}")
        if self.activations_from is not None:
            check_integer("activations_from", self.activations_from, minimum=1)

    def to_hf_dict(self) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` of a converted quantized folder (the
        activations are a serving choice, not part of the checkpoint)."""
        return {"quant_method": QUANT_METHOD, "weights": self.weights}

    @classmethod
    def from_hf_dict(cls, raw: Any) -> Quantization:
        if not isinstance(raw, dict) or raw.get("quant_method") != QUANT_METHOD:
            method = raw.get("quant_method") if isinstance(raw, dict) else raw
            raise ConfigError(f"quantization_config {method!r} is not supported: focus_jax reads "
                              f"the folders it quantized itself (focus-jax convert --quantize) "
                              f"and FP8 weights with scales (quant_method "
                              f"{', '.join(FP8_CHECKPOINT_METHODS)}; compressed-tensors in its "
                              f"float-quantized format)")
        return cls(raw.get("weights"))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Geometry of a block-diffusion decoder: the Qwen3-style layers of SDAR, with a mixture of
    experts (``moe``) in sparse families. Each family (:mod:`focus_jax.models`) reads its own
    Hugging Face ``config.json`` into this."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    block_size: int | None = None
    """The block size the model was trained with (None: unknown, any supported size is accepted)."""
    mask_token_id: int | None = None
    model_type: str = "sdar"
    dtype: str = "bfloat16"
    """Parameter and activation dtype; norms, softmax and logits are always computed in float32."""
    partial_rotary_factor: float = 1.0
    """The share of each head's features that RoPE rotates (the first ones)."""
    moe: MoEConfig | None = None
    """The mixture of experts (None: every layer has a dense MLP)."""
    quantization: Quantization | None = None
    """8-bit weights (None: every weight in ``dtype``)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        from focus_jax.models import family  # the registry imports this module

        family(self.model_type)
        if not (_is_finite(self.partial_rotary_factor) and 0 < self.partial_rotary_factor <= 1):
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got "
                              f"{self.partial_rotary_factor!r}")
        if self.rotary_dim % 2:
            raise ConfigError(f"the rotary part of a head ({self.rotary_dim} of {self.head_dim} "
                              f"features) must be even")
        if self.moe is not None:
            outside = [i for i in self.moe.dense_layers if not 0 <= i < self.num_layers]
            if outside:
                raise ConfigError(f"dense layer(s) {outside} are outside the {self.num_layers} "
                                  f"layers (mlp_only_layers / first_k_dense_replace)")
        if self.block_size is not None and self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(f"block_size {self.block_size} is not supported; supported: "
                              f"{SUPPORTED_BLOCK_SIZES}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                              f"(vocab_size {self.vocab_size})")
        _dtype(self.dtype)

    @property
    def jnp_dtype(self) -> Any:
        return _dtype(self.dtype)

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE rotates."""
        return round(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's feed-forward: ``dense`` (an MLP) or ``sparse`` (experts)."""
        dense = () if self.moe is None else self.moe.dense_layers
        return tuple("dense" if self.moe is None or i in dense else "sparse"
                     for i in range(self.num_layers))

    @property
    def attention_params(self) -> int:
        """One layer's Q/K/V and output projection weights."""
        return self.hidden_size * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)

    def feed_forward_params(self, active: bool = False) -> int:
        """The feed-forward weights of all layers (``active``: those a token runs through, the
        router and its chosen and shared experts)."""
        e, total = self.hidden_size, 0
        for kind in self.layer_kinds:
            if kind == "dense":
                total += 3 * e * self.intermediate_size
            else:
                m = self.moe
                experts = m.experts_per_token if active else m.num_experts
                total += 3 * e * (experts * m.expert_size + m.shared_expert_size) + e * m.num_experts
        return total

    def _params(self, active: bool) -> int:
        e, norms = self.hidden_size, 2 * self.head_dim + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return (self.vocab_size * e + self.num_layers * (self.attention_params + norms)
                + self.feed_forward_params(active) + e + head)

    @property
    def num_params(self) -> int:
        """Parameter count (the LM head counted once when tied)."""
        return self._params(active=False)

    @property
    def active_params(self) -> int:
        """Parameters a token runs through (the chosen experts only)."""
        return self._params(active=True)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], dtype: str | None = None) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dictionary, through the family its
        ``model_type`` names (:mod:`focus_jax.models`)."""
        from focus_jax.models import family

        cfg = family(raw.get("model_type")).config_from_hf(raw, dtype or hf_dtype(raw))
        quantization = raw.get("quantization_config")
        if quantization is not None and not is_fp8_checkpoint(quantization):
            cfg = cfg.replace(quantization=Quantization.from_hf_dict(quantization))
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dictionary that :meth:`from_hf_dict` reads back."""
        from focus_jax.models import family

        out = family(self.model_type).config_to_hf(self)
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_hf_dict()
        return out

    @classmethod
    def from_file(cls, path: str | Path, dtype: str | None = None) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist: a model folder needs a config.json") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON ({err}); re-download or re-convert "
                              f"the checkpoint") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object, found {type(raw).__name__}")
        return cls.from_hf_dict(raw, dtype=dtype)


def hf_dtype(raw: dict[str, Any]) -> str:
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return name if name in ("bfloat16", "float32") else "bfloat16"


def is_integer(value: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_integer(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as a Python int if it is an integer (>= ``minimum``), else ``ConfigError``
    naming ``name``: a fraction would be truncated somewhere below, silently."""
    if not is_integer(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ConfigError(f"{name} must be an integer{bound}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool if it is one (Python or NumPy), else ``ConfigError`` naming
    ``name``: a string such as ``"false"`` would be true."""
    if not isinstance(value, bool | np.bool_):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _is_finite(value: Any) -> bool:
    """A finite real number (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _sequence(name: str, value: Any) -> tuple[Any, ...]:
    """The elements of a list, tuple or 1-D array field (a string or a mapping is refused)."""
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{name} must be a sequence, got {value!r}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to decode. ``None`` fields take the model's or the mode's default.

    ``mode``: ``baseline`` (every step runs the whole block), ``delayed`` (delayed KV cache) or
    ``focus`` (delayed cache + FOCUS eviction). ``threshold`` defaults to 0.9 / 0.9 / 0.8.
    ``denoising_steps`` sets how many tokens the static and sequential rules unmask per step
    (``ceil(block_size / denoising_steps)``; default: one per step).
    """

    mode: Mode = "focus"
    block_size: int | None = None
    threshold: float | None = None
    alpha: float = 1.5
    unmasking: UnmaskingRule = "low_confidence_dynamic"
    denoising_steps: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    commit_refresh: bool = True
    """At each block's commit step, run all its slots through every layer once more with their
    final tokens, so that the block's KV equals what ``baseline`` holds instead of the delayed
    cache's, frozen while slots to their right were still masks (``delayed`` and ``focus``; one
    extra pass of B tokens per block, never evicted; ``baseline`` refreshes every step anyway).
    A per-request setting (``SamplingParams``): it changes no compiled program."""
    stop_token_ids: tuple[int, ...] | None = None
    """None: the tokenizer's EOS (and the model's configured stop ids)."""
    max_batch: int | None = None
    """Slots decoded together (None: all prompts at once, up to 64)."""
    max_cache_len: int | None = None
    """Cache positions per slot (None: the longest prompt plus max_new_tokens, rounded up)."""
    bucket_ladder: tuple[float, ...] | None = None
    """Bucket sizes for compaction, as fractions of the flat token axis slots * block_size,
    of the processed and the retained rows alike (None: the platform's, :meth:`ladder_for` and
    :meth:`processed_ladder_for`)."""
    kernels: str | None = None
    """Kernels for attention and FOCUS importance: ``xla``, ``pallas_tpu``,
    ``pallas_tpu_interpret``, ``triton``, or ``pallas_triton`` / ``pallas_triton_interpret``
    (attention through Pallas's Triton backend, importance the platform's default; experimental,
    not yet run on a GPU) (None: the platform's default)."""
    steps_per_round: int = 16
    """Denoising steps run on the device per host round trip: requests are admitted, and blocks
    streamed, between rounds. 16 measured as fast as 32 at SDAR-8B batch 256 on an H200 (3244 vs
    3241 output tok/s; 8: 3225) while halving the wait for a round to end (docs/benchmarks.md,
    "Request lifecycle")."""

    free_slot_round_steps: int = 4
    """Steps per round while a slot is free and no request waits: a request that arrives
    meanwhile waits at most this many steps to be admitted (instead of a whole round). The
    same compiled round runs both lengths."""

    kv_cache: KVLayout = "contiguous"
    """The KV cache's layout: ``contiguous`` (every slot reserves ``max_cache_len`` positions)
    or ``paged`` (a pool of pages of one block; a request holds the pages of its prompt and
    ``max_new_tokens``, and waits for them when the pool is short)."""

    kv_pages: int | None = None
    """Pages in a paged cache's pool (None: from ``kv_cache_memory``, else the device memory
    left after the weights, else, on devices that do not report their memory, as many as the
    contiguous cache's positions)."""

    kv_cache_memory: int | None = None
    """Bytes per device for a paged cache's pool (None: see ``kv_pages``)."""

    prefix_caching: bool = False
    """Paged cache only: requests share the pages of the prompt blocks they have in common with
    an earlier request (whole leading blocks), which are then prefilled once."""

    interruptible_rounds: bool = False
    """Rounds ask the host after every step whether to end (a host callback in the round's loop,
    :mod:`focus_jax.interrupts`), so a request that arrives while a slot is free is admitted at
    the next step rather than when the round ends (servers: :class:`~focus_jax.engine.AsyncEngine`
    sets the flag). One process only."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.unmasking not in UNMASKING_RULES:
            raise ConfigError(f"unmasking {self.unmasking!r} is not one of "
                              f"{', '.join(UNMASKING_RULES)}")
        self._integer("block_size", optional=True)
        if self.block_size is not None and self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(f"block_size {self.block_size} is not supported; supported: "
                              f"{SUPPORTED_BLOCK_SIZES}")
        self._number("threshold", 0.0, 1.0, optional=True)
        self._number("alpha", 0.0, low_open=True)
        self._integer("denoising_steps", minimum=1, optional=True)
        self._integer("max_new_tokens", minimum=1)
        self._number("temperature", 0.0)
        self._integer("top_k", minimum=0)
        self._number("top_p", 0.0, 1.0, low_open=True)
        self._integer("seed")
        object.__setattr__(self, "commit_refresh", check_bool("commit_refresh",
                                                              self.commit_refresh))
        self._integer("max_batch", minimum=1, optional=True)
        self._integer("max_cache_len", minimum=1, optional=True)
        self._integer("steps_per_round", minimum=1)
        self._integer("free_slot_round_steps", minimum=1)
        if self.kv_cache not in KV_LAYOUTS:
            raise ConfigError(f"kv_cache {self.kv_cache!r} is not one of {', '.join(KV_LAYOUTS)}")
        self._integer("kv_pages", minimum=1, optional=True)
        self._integer("kv_cache_memory", minimum=1, optional=True)
        if self.kv_cache != "paged" and (self.kv_pages or self.kv_cache_memory
                                         or self.prefix_caching):
            raise ConfigError("kv_pages, kv_cache_memory and prefix_caching need "
                              "kv_cache='paged'")
        if self.stop_token_ids is not None:
            ids = _sequence("stop_token_ids", self.stop_token_ids)
            if not all(is_integer(t) and t >= 0 for t in ids):
                raise ConfigError(f"stop_token_ids must be token ids (integers >= 0), got "
                                  f"{self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if self.bucket_ladder is not None:
            ladder = _sequence("bucket_ladder", self.bucket_ladder)
            if not ladder or not all(_is_finite(f) and 0.0 < f <= 1.0 for f in ladder):
                raise ConfigError(f"bucket_ladder must be fractions in (0, 1], got "
                                  f"{self.bucket_ladder!r}")
            if max(ladder) != 1.0:
                raise ConfigError("bucket_ladder must end at 1.0 so that every token fits a bucket")
            object.__setattr__(self, "bucket_ladder", tuple(float(f) for f in ladder))

    def _integer(self, name: str, minimum: int | None = None, optional: bool = False) -> None:
        value = getattr(self, name)
        if not (value is None and optional):
            object.__setattr__(self, name, check_integer(name, value, minimum))

    def _number(self, name: str, low: float, high: float = math.inf, low_open: bool = False,
                optional: bool = False) -> None:
        """Check the field ``name`` is a finite number in [low, high] (``(low, high]`` with
        ``low_open``), stored as a Python float. (NaN passes no comparison: it is refused.)"""
        value = getattr(self, name)
        if value is None and optional:
            return
        if not (_is_finite(value) and (value > low if low_open else value >= low)
                and value <= high):
            left = "(" if low_open else "["
            wanted = (f"in {left}{low:g}, {high:g}]" if math.isfinite(high)
                      else f"{'>' if low_open else '>='} {low:g}")
            raise ConfigError(f"{name} must be a finite number {wanted}, got {value!r}")
        object.__setattr__(self, name, float(value))

    def ladder_for(self, platform: str) -> tuple[float, ...]:
        """The bucket ladder on devices of ``platform``: the configured one, else
        ``CPU_LADDER`` on CPUs, ``GPU_LADDER`` on GPUs and ``DEFAULT_LADDER`` elsewhere (TPUs)."""
        if self.bucket_ladder is not None:
            return self.bucket_ladder
        return {"cpu": CPU_LADDER, "gpu": GPU_LADDER}.get(platform, DEFAULT_LADDER)

    def processed_ladder_for(self, platform: str) -> tuple[float, ...]:
        """The bucket ladder of the processed rows (layers 0-1, the eviction) on devices of
        ``platform``: the configured ladder, else ``GPU_PROCESSED_LADDER`` on GPUs and the
        platform's ladder (:meth:`ladder_for`) elsewhere."""
        if self.bucket_ladder is None and platform == "gpu":
            return GPU_PROCESSED_LADDER
        return self.ladder_for(platform)

    @staticmethod
    def min_bucket_for(platform: str) -> int:
        """The fewest rows a compaction bucket has on devices of ``platform``
        (``GPU_MIN_BUCKET`` on GPUs, 1 elsewhere)."""
        return GPU_MIN_BUCKET if platform == "gpu" else 1

    @property
    def resolved_threshold(self) -> float:
        return DEFAULT_THRESHOLD[self.mode] if self.threshold is None else self.threshold

    def replace(self, **changes: Any) -> GenerationConfig:
        return dataclasses.replace(self, **changes)
