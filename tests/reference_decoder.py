"""An uncached block-diffusion decoder written straight from SPEC_FOCUS sections 2-3.

Every step recomputes the whole sequence with the block-causal mask (``Model.logits``) and
applies the unmasking rule in NumPy, one sequence at a time. It shares nothing with the engine
but the model's forward, which the parity tests pin to ``transformers``.
"""

from __future__ import annotations

import math

import numpy as np


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


def reference_decode(model, prompt: list[int], block_size: int, *, threshold: float,
                     max_new_tokens: int, stop_ids: tuple[int, ...] = (),
                     rule: str = "low_confidence_dynamic",
                     denoising_steps: int | None = None) -> tuple[list[int], list[int]]:
    """Generated token ids and the number of tokens decoded at each step."""
    b = block_size
    mask = model.mask_token_id
    per_step = math.ceil(b / (denoising_steps or b))
    p = len(prompt)
    history = (p // b) * b
    seq = list(prompt) + [mask] * (history + b - p)
    is_masked = [False] * p + [True] * (history + b - p)
    decoded_per_step = []
    while True:
        while any(is_masked[history:history + b]):
            logits = np.asarray(model.logits(np.array([seq]), b))[0, history:history + b]
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
        history += b
        seq += [mask] * b
        is_masked += [True] * b
