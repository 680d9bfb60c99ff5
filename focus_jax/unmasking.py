"""Choosing tokens and deciding which masked slots to unmask (SPEC_FOCUS section 3.2)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Greedy when ``temperature == 0``; otherwise temperature with optional top-k / top-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __call__(self, logits: Float[Array, "n v"],
                 keys: Array) -> tuple[Int[Array, "n"], Float[Array, "n"]]:
        """Token per row and its confidence: the full-vocabulary softmax probability of the token.

        With temperature the probability is that of ``softmax(logits / temperature)``, not
        renormalised after top-k / top-p filtering (as the reference engine computes it).
        """
        if self.temperature == 0.0:
            token = jnp.argmax(logits, axis=-1)
            confidence = 1.0 / jnp.sum(jnp.exp(logits - logits.max(axis=-1, keepdims=True)), -1)
            return token.astype(jnp.int32), confidence
        scaled = logits / self.temperature
        log_probs = jax.nn.log_softmax(scaled, axis=-1)
        token = jax.vmap(self._sample)(scaled, keys)
        confidence = jnp.exp(jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0])
        return token, confidence

    def _sample(self, scaled: Float[Array, "v"], key: Array) -> Int[Array, ""]:
        if self.top_k > 0:
            values, ids = jax.lax.top_k(scaled, self.top_k)
        else:
            ids = jnp.argsort(-scaled)
            values = scaled[ids]
        if self.top_p < 1.0:
            probs = jax.nn.softmax(values)
            before = jnp.cumsum(probs) - probs  # mass of strictly more likely tokens
            values = jnp.where(before < self.top_p, values, -jnp.inf)
        return ids[jax.random.categorical(key, values)].astype(jnp.int32)


def unmask(candidates: Bool[Array, "s b"], confidence: Float[Array, "s b"], rule: str,
           threshold: float, per_step: int) -> Bool[Array, "s b"]:
    """The candidate slots to unmask this step.

    ``low_confidence_dynamic``: every candidate with confidence >= threshold, else the single
    most confident (ties: lowest slot). ``low_confidence_static``: the ``per_step`` most confident.
    ``sequential``: the ``per_step`` leftmost candidates.
    """
    b = candidates.shape[-1]
    index = jnp.arange(b)
    score = jnp.where(candidates, confidence, -1.0)
    if rule == "low_confidence_dynamic":
        chosen = candidates & (confidence >= threshold)
        best = (index[None, :] == jnp.argmax(score, axis=-1)[:, None]) & candidates
        return jnp.where(chosen.any(axis=-1, keepdims=True), chosen, best)
    if rule == "low_confidence_static":
        beats = (score[:, None, :] > score[:, :, None]) | (
            (score[:, None, :] == score[:, :, None]) & (index[None, :] < index[:, None])[None])
        rank = (beats & candidates[:, None, :]).sum(axis=-1)
        return candidates & (rank < per_step)
    if rule == "sequential":
        return candidates & (jnp.cumsum(candidates, axis=-1) <= per_step)
    raise ValueError(f"unknown unmasking rule {rule!r}")
