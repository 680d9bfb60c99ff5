"""Uncached block-diffusion decoders written straight from SPEC_FOCUS sections 2-5.

``baseline``: every step recomputes the whole sequence with the block-causal mask
(``Model.logits``): the KV the baseline's cache holds, rewritten every step.

``delayed``: the delayed KV cache (section 5) keeps keys and values computed at earlier steps.
Every KV it ever holds is one row of a single uncached forward (``forward_hidden`` under a mask
built here): the row of slot ``i`` at a step is the token at ``h + i`` at that position, and it
attends, for each position below the step's ``kv_len``, to the row the cache holds for it at
that step (the one written in the same step if the position was processed, since each layer
writes before it attends; else the latest earlier one). A row attends only to rows of its own
or earlier steps, so recomputing every row each step gives the earlier rows their old values.
Processed tokens run every layer (no eviction), so one mask serves all layers. With
``commit_refresh`` the commit step processes the whole block.

The unmasking rule runs in NumPy, one sequence at a time. Nothing is shared with the engine but
the model's forward, which the parity tests pin to ``transformers``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focus_jax.models.decoder import forward_hidden


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _select(masked: np.ndarray, conf: np.ndarray, rule: str, threshold: float,
            per_step: int) -> list[int]:
    slots = [i for i in range(len(masked)) if masked[i]]
    if rule == "low_confidence_dynamic":
        chosen = [i for i in slots if conf[i] >= threshold]
        if not chosen:
            best = max(conf[i] for i in slots)
            chosen = [min(i for i in slots if conf[i] == best)]
        return chosen
    if rule == "low_confidence_static":
        return sorted(slots, key=lambda i: (-conf[i], i))[:per_step]
    if rule == "sequential":
        return slots[:per_step]
    raise ValueError(rule)


@functools.partial(jax.jit, static_argnums=0)
def _row_logits(graphdef, params, tokens, positions, mask):
    model = nnx.merge(graphdef, params)
    x, _ = forward_hidden(model, tokens[None], positions[None], mask[None])
    return model.head(x)[0]


class _Uncached:
    """``baseline``: the block's logits from the whole sequence, recomputed."""

    def __init__(self, model, block_size: int):
        self.model, self.b = model, block_size

    def block_logits(self, seq: list[int], is_masked: list[bool], history: int) -> np.ndarray:
        # Padded with whole blocks of masks to a few lengths (a few compiles): under the
        # block-causal mask no earlier position sees a later block.
        size = max(64, 1 << (len(seq) - 1).bit_length())
        padded = seq + [self.model.mask_token_id] * (size - len(seq))
        logits = self.model.logits(np.array([padded]), self.b)
        return np.asarray(logits)[0, history:history + self.b]

    def commit(self, seq: list[int], history: int) -> None:
        pass


class _DelayedCache:
    """``delayed``: every KV the cache writes for one sequence, as rows of one forward."""

    def __init__(self, model, block_size: int, prompt_blocks: list[int], commit_refresh: bool):
        self.model, self.b, self.commit_refresh = model, block_size, commit_refresh
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.sees: list[list[int]] = []
        self.latest: dict[int, int] = {}
        """The row whose KV the cache holds for each position."""
        self.cached = [False] * block_size
        """The active block's CACHED flags."""
        for start in range(0, len(prompt_blocks), block_size):  # prefill, block-causal
            self._write(prompt_blocks, range(start, start + block_size), start + block_size)

    def _write(self, seq: list[int], positions: range | list[int], kv_len: int) -> list[int]:
        """One step's processed tokens: rows that attend to each other and, at the other
        positions below ``kv_len``, to the rows the cache holds. Returns their rows."""
        rows = {p: len(self.tokens) + n for n, p in enumerate(positions)}
        seen = [rows.get(p, self.latest.get(p)) for p in range(kv_len)]
        assert None not in seen, "a position below kv_len has no KV"
        for p in positions:
            self.tokens.append(seq[p])
            self.positions.append(p)
            self.sees.append(seen)
        self.latest.update(rows)
        return list(rows.values())

    def _logits(self, rows: list[int]) -> np.ndarray:
        n = len(self.tokens)
        size = max(64, 1 << (n - 1).bit_length())  # a few shapes, a few compiles
        mask = np.eye(size, dtype=bool)  # padding rows see themselves; no row sees them
        for row, seen in enumerate(self.sees):
            mask[row, :] = False
            mask[row, seen] = True
        tokens = np.zeros(size, np.int32)
        positions = np.zeros(size, np.int32)
        tokens[:n], positions[:n] = self.tokens, self.positions
        logits = _row_logits(self.model.graphdef, self.model.params, jnp.asarray(tokens),
                             jnp.asarray(positions), jnp.asarray(mask))
        return np.asarray(logits)[rows]

    def block_logits(self, seq: list[int], is_masked: list[bool], history: int) -> np.ndarray:
        """Logits of the active block's slots (zeros for cached slots, which are not masked and
        so never read); the CACHED flags settle from the states at this step's input."""
        b = self.b
        processed = [i for i in range(b) if not self.cached[i]]
        rows = self._write(seq, [history + i for i in processed], history + processed[-1] + 1)
        logits = np.zeros((b, self.model.config.vocab_size), np.float32)
        logits[processed] = self._logits(rows)
        masked = is_masked[history:history + b]
        for i in processed:
            if not masked[i] and (i == b - 1 or not masked[i + 1]):
                self.cached[i] = True
        return logits

    def commit(self, seq: list[int], history: int) -> None:
        """The commit step: the slots not yet cached (all of them with ``commit_refresh``) run
        once more with their final tokens."""
        processed = [i for i in range(self.b) if self.commit_refresh or not self.cached[i]]
        if processed:
            self._write(seq, [history + i for i in processed], history + processed[-1] + 1)
        self.cached = [False] * self.b


def reference_decode(model, prompt: list[int], block_size: int, *, threshold: float,
                     max_new_tokens: int, stop_ids: tuple[int, ...] = (),
                     rule: str = "low_confidence_dynamic", denoising_steps: int | None = None,
                     mode: str = "baseline",
                     commit_refresh: bool = False) -> tuple[list[int], list[int]]:
    """Generated token ids and the number of tokens decoded at each step. ``mode``:
    ``baseline`` or ``delayed`` (``commit_refresh`` applies to ``delayed``)."""
    b = block_size
    mask = model.mask_token_id
    per_step = math.ceil(b / (denoising_steps or b))
    p = len(prompt)
    history = (p // b) * b
    seq = list(prompt) + [mask] * (history + b - p)
    is_masked = [False] * p + [True] * (history + b - p)
    if mode == "baseline":
        cache = _Uncached(model, b)
    elif mode == "delayed":
        cache = _DelayedCache(model, b, seq[:history], commit_refresh)
    else:
        raise ValueError(mode)
    decoded_per_step = []
    while True:
        while any(is_masked[history:history + b]):
            logits = cache.block_logits(seq, is_masked, history)
            probs = _softmax(logits.astype(np.float64))
            token = logits.argmax(axis=-1)
            conf = probs[np.arange(b), token]
            chosen = _select(np.array(is_masked[history:history + b]), conf, rule, threshold,
                             per_step)
            for i in chosen:
                seq[history + i] = int(token[i])
                is_masked[history + i] = False
            decoded_per_step.append(len(chosen))
        generated = seq[p:history + b]
        for j in range(max(history, p), history + b):
            if seq[j] in stop_ids:
                return seq[p:j][:max_new_tokens], decoded_per_step
        if len(generated) >= max_new_tokens:
            return generated[:max_new_tokens], decoded_per_step
        cache.commit(seq, history)
        history += b
        seq += [mask] * b
        is_masked += [True] * b
