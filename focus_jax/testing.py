"""Tiny models and tokenizers for tests, demos without a checkpoint, and quick experiments."""

from __future__ import annotations

import contextlib
import string
from collections.abc import Iterator
from typing import Any

import numpy as np
from flax import nnx

from focus_jax.config import ModelConfig
from focus_jax.model import Model
from focus_jax.models.decoder import Decoder
from focus_jax.train.tokenizer import SPECIAL_TOKENS, wrap

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
"""XLA options of the test suite: LLVM's optimisation is about half of a CPU compile, and tests
compile hundreds of small programs that each run briefly (a focus round of the tiny model:
13.5 s of backend compile with the defaults, 6.5 s with these; the same tokens; docs/startup.md,
"The test suite"). Numerics are XLA's either way: these options change the machine code's speed,
not which operations run or in what precision."""


OPTIMISING_CPU_OPTIONS = {"xla_backend_optimization_level": 2,
                          "xla_llvm_disable_expensive_passes": False}
"""XLA's defaults for the options of TEST_XLA_FLAGS, as per-program compiler options: they
override the process's ``XLA_FLAGS`` for the programs compiled with them."""


@contextlib.contextmanager
def optimising_cpu_compiles() -> Iterator[None]:
    """Engine programs made while the block runs compile with XLA's optimising CPU backend
    (OPTIMISING_CPU_OPTIONS), not the tests' cheap compile: for tests that run a program far more
    than they compile it (the bundled model's round on 8 slots, warmed up and run for 32
    requests of 32 tokens: 9.7 + 16.2 CPU s with TEST_XLA_FLAGS, 12.3 + 6.3 with these; the same
    tokens). A program already made (``compilation.PROGRAMS``, by shape and settings) is reused
    as it was compiled."""
    from focus_jax import compilation

    before = compilation.CPU_COMPILER_OPTIONS
    compilation.CPU_COMPILER_OPTIONS = OPTIMISING_CPU_OPTIONS
    try:
        yield
    finally:
        compilation.CPU_COMPILER_OPTIONS = before


def xla_flags(*extra: str, base: str = "") -> str:
    """``XLA_FLAGS`` for a test process: ``base`` (e.g. the caller's environment), the test
    options and ``extra`` (e.g. ``--xla_force_host_platform_device_count=8``)."""
    return " ".join([*base.split(), *(f for f in TEST_XLA_FLAGS if f not in base), *extra])


def char_tokenizer() -> Any:
    """A character-level tokenizer over printable ASCII, with pad / EOS / mask / chat tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return wrap(core)


def tiny_config(**overrides: Any) -> ModelConfig:
    """A few-layer float32 geometry that runs in milliseconds on a CPU."""
    fields: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10_000.0, max_position_embeddings=4096,
        block_size=None, mask_token_id=SPECIAL_TOKENS.index("<|mask|>"), dtype="float32")
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(seed: int = 0, scale: float = 1.0, tokenizer: bool = False,
               **overrides: Any) -> Model:
    """A random tiny model. ``scale`` multiplies every weight (larger: sharper distributions)."""
    cfg = tiny_config(**overrides)
    decoder = Decoder(cfg, rngs=nnx.Rngs(seed))
    if scale != 1.0:
        graphdef, state = nnx.split(decoder)
        state = nnx.map_state(lambda path, v: v * scale if "norm" not in path else v, state)
        decoder = nnx.merge(graphdef, state)
    tok = char_tokenizer() if tokenizer else None
    eos = SPECIAL_TOKENS.index("<|endoftext|>")
    return Model.from_decoder(decoder, tok, stop_token_ids=(eos,))


def random_prompts(count: int, vocab: int, min_len: int, max_len: int,
                   seed: int = 0, low: int = len(SPECIAL_TOKENS)) -> list[list[int]]:
    """Random token-id prompts of lengths in ``[min_len, max_len]`` avoiding special tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab, size=int(rng.integers(min_len, max_len + 1))).tolist()
            for _ in range(count)]
