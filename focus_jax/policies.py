"""The parts of a denoising step, as frozen strategy objects that the step composes.

- **processed-token policy** (SPEC_FOCUS 4-5): which slots of the active block run layers 0-1
  this step, and how slot states settle afterwards: :class:`WholeBlock` (``baseline``) or
  :class:`DelayedCache` (``delayed`` and ``focus``, optionally refreshing a block at its commit
  step);
- **eviction policy** (SPEC_FOCUS 6): which processed tokens go on through layers >= 2:
  :class:`NoEviction` or :class:`FocusEviction`;
- **unmasking rule** (SPEC_FOCUS 3.2): :class:`UnmaskingRule`;
- **sampler**: the token a row gets and its confidence, from its own slot's temperature, top-k,
  top-p and seed (:class:`Sampler`).

Everything a request may set for itself (temperature, top-k, top-p, threshold, alpha, seed,
commit refresh) arrives as per-slot arrays of the decode state, so one compiled step serves
every mix of them; only the choice of policies (the mode, the unmasking rule) changes the
program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from focus_jax import focus
from focus_jax.unmasking import unmask
from pallas_kernels.focus_importance import focus_importance, focus_importance_sharded

MASKED, UNMASKED, CACHED = 0, 1, 2


def kernel(op: Callable, sharded_op: Callable, impl: str | None, mesh: Mesh | None) -> Callable:
    """``op`` with implementation ``impl``; on a mesh, its sharded entry point, which runs it
    inside ``shard_map`` over the mesh axes the step leaves to the partitioner: a Mosaic or
    Triton call cannot be partitioned, and each device then works on its own slots and heads."""
    if mesh is None:
        return functools.partial(op, impl=impl)
    return functools.partial(sharded_op, mesh, impl=impl)


class ProcessedTokens(Protocol):
    """Which slots of the active block run layers 0-1, and how slot states settle after.

    ``commit_refresh`` is each slot's choice (a per-request setting, not a compiled one): at
    the commit step of its block (no slot masked), the whole block runs once more with its final
    tokens, so that the block's KV no longer holds what its slots computed while their right
    neighbours were still masks. Eviction never applies to it: no slot of a committing block is
    masked, and only masked tokens are evicted.
    """

    def processed(self, live: Bool[Array, "s"], slot_state: Int[Array, "s b"],
                  commit_refresh: Bool[Array, "s"]) -> Bool[Array, "s b"]:
        ...

    def settle(self, slot_state: Int[Array, "s b"], before: Int[Array, "s b"],
               processed: Bool[Array, "s b"]) -> Int[Array, "s b"]:
        ...


@dataclasses.dataclass(frozen=True)
class WholeBlock:
    """``baseline``: every slot of a live block, every step; its KV is rewritten each step (so
    every commit step refreshes the block, whatever ``commit_refresh`` says)."""

    def processed(self, live: Bool[Array, "s"], slot_state: Int[Array, "s b"],
                  commit_refresh: Bool[Array, "s"]) -> Bool[Array, "s b"]:
        return jnp.broadcast_to(live[:, None], slot_state.shape)

    def settle(self, slot_state: Int[Array, "s b"], before: Int[Array, "s b"],
               processed: Bool[Array, "s b"]) -> Int[Array, "s b"]:
        return slot_state


@dataclasses.dataclass(frozen=True)
class DelayedCache:
    """The delayed KV cache (SPEC 5): only slots whose KV is not final run; at the commit step,
    every slot of the block where the slot's request asks for ``commit_refresh``."""

    def processed(self, live: Bool[Array, "s"], slot_state: Int[Array, "s b"],
                  commit_refresh: Bool[Array, "s"]) -> Bool[Array, "s b"]:
        refreshing = commit_refresh & ~(slot_state == MASKED).any(axis=-1)
        return live[:, None] & ((slot_state != CACHED) | refreshing[:, None])

    def settle(self, slot_state: Int[Array, "s b"], before: Int[Array, "s b"],
               processed: Bool[Array, "s b"]) -> Int[Array, "s b"]:
        """From the states at the step's input (``before``): a token decoded now is re-run once
        with its real embedding next step; a decoded token right before a mask stays live."""
        unmasked = before != MASKED
        settled = unmasked & jnp.pad(unmasked[:, 1:], ((0, 0), (0, 1)), constant_values=True)
        return jnp.where(processed & settled, CACHED, slot_state)


class Eviction(Protocol):
    """Which processed tokens run the layers >= 2 (the others stop inside layer 1)."""

    def retained(self, processed: Bool[Array, "s b"], masked: Bool[Array, "s b"],
                 first_layers: tuple[Array, Array, Array, Array], progress: Int[Array, "s"],
                 avg_decoded: Float[Array, "s"], alpha: Float[Array, "s"]) -> Bool[Array, "s b"]:
        ...


@dataclasses.dataclass(frozen=True)
class NoEviction:
    """Every processed token runs every layer."""

    evicts = False

    def retained(self, processed, masked, first_layers, progress, avg_decoded, alpha):
        return processed


@dataclasses.dataclass(frozen=True)
class FocusEviction:
    """FOCUS (SPEC 6): masked tokens whose importance does not rise from layer 0 to layer 1 are
    evicted; processed tokens that are not masked (delayed-cache refreshes) always stay."""

    kernels: str | None = None
    """Implementation of the importance kernel (None: the platform's default)."""
    mesh: Mesh | None = None
    """The decode state's mesh (the kernel then runs through its sharded entry point)."""

    evicts = True

    def retained(self, processed: Bool[Array, "s b"], masked: Bool[Array, "s b"],
                 first_layers: tuple[Array, Array, Array, Array], progress: Int[Array, "s"],
                 avg_decoded: Float[Array, "s"], alpha: Float[Array, "s"]) -> Bool[Array, "s b"]:
        """``first_layers``: queries and keys ``[s, b, heads, d]`` of layers 0 and 1 (q0, k0,
        q1, k1) after q/k-norm and RoPE; ``alpha`` each slot's budget factor."""
        q0, k0, q1, k1 = first_layers
        masked_processed = processed & masked

        def importance(q: Array, k: Array) -> Array:
            return kernel(focus_importance, focus_importance_sharded, self.kernels, self.mesh)(
                q, k, masked_processed)

        delta = importance(q1, k1) - importance(q0, k0)
        return processed & ~masked | focus.select_retained(delta, masked_processed, progress,
                                                           avg_decoded, alpha)


@dataclasses.dataclass(frozen=True)
class UnmaskingRule:
    """Which candidate slots a step decodes (``unmasking.unmask``), with each slot's threshold."""

    name: str = "low_confidence_dynamic"
    per_step: int = 1
    """Tokens the static and sequential rules unmask per step."""

    def __call__(self, candidates: Bool[Array, "s b"], confidence: Float[Array, "s b"],
                 threshold: Float[Array, "s"]) -> Bool[Array, "s b"]:
        return unmask(candidates, confidence, self.name, threshold[:, None], self.per_step)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """The sampling settings of ``n`` rows (gathered from their slots)."""

    temperature: Float[Array, "n"]
    top_k: Int[Array, "n"]
    top_p: Float[Array, "n"]
    seed: Int[Array, "n"]
    position: Int[Array, "n"]
    """Absolute position of the row's token (names its random draw)."""
    draw: Int[Array, "n"]
    """How many steps of its block the slot has decoded in (a fresh draw per step)."""


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Per row: greedy where the temperature is 0, else temperature sampling with optional top-k
    and top-p. A row's random draw depends on its request's seed, its position and the step of
    its block only, so a request samples the same tokens in any slot and any batch."""

    def __call__(self, logits: Float[Array, "n v"],
                 rows: RowSampling) -> tuple[Int[Array, "n"], Float[Array, "n"]]:
        """Token per row and its confidence: the full-vocabulary softmax probability of the token
        (with temperature, of ``softmax(logits / temperature)``, not renormalised after top-k /
        top-p filtering, as the reference engine computes it)."""
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        confidence = 1.0 / jnp.sum(jnp.exp(logits - logits.max(axis=-1, keepdims=True)), -1)
        sampled = rows.temperature > 0
        # Greedy batches skip the sort over the vocabulary at run time (one compiled program).
        drawn, drawn_confidence = jax.lax.cond(
            sampled.any(), lambda: self._sample(logits, rows), lambda: (token, confidence))
        return jnp.where(sampled, drawn, token), jnp.where(sampled, drawn_confidence, confidence)

    @staticmethod
    def _sample(logits: Float[Array, "n v"],
                rows: RowSampling) -> tuple[Int[Array, "n"], Float[Array, "n"]]:
        v = logits.shape[-1]
        scaled = logits / jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
        log_probs = jax.nn.log_softmax(scaled, axis=-1)
        order = jnp.argsort(-scaled, axis=-1, stable=True)
        values = jnp.take_along_axis(scaled, order, axis=-1)
        rank = jnp.arange(v)
        in_top_k = (rows.top_k[:, None] == 0) | (rank[None, :] < rows.top_k[:, None])
        values = jnp.where(in_top_k, values, -jnp.inf)
        # top-p over the top-k tokens' renormalised probabilities: keep a token while the mass
        # of the strictly more likely ones is below p.
        probs = jax.nn.softmax(values, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        values = jnp.where(before < rows.top_p[:, None], values, -jnp.inf)

        def draw(seed, position, step, row_values):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), position), step)
            return jax.random.categorical(key, row_values)

        choice = jax.vmap(draw)(rows.seed, rows.position, rows.draw, values)
        token = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
        confidence = jnp.exp(jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0])
        return token, confidence


@dataclasses.dataclass(frozen=True)
class Policies:
    """The policies one decode program composes."""

    processing: ProcessedTokens
    eviction: NoEviction | FocusEviction
    unmasking: UnmaskingRule
    sampler: Sampler = Sampler()

    @classmethod
    def for_mode(cls, mode: str, unmasking: str = "low_confidence_dynamic", per_step: int = 1,
                 kernels: str | None = None, mesh: Mesh | None = None) -> Policies:
        """``baseline``: whole block, no eviction; ``delayed``: delayed cache; ``focus``:
        delayed cache + FOCUS eviction."""
        if mode not in ("baseline", "delayed", "focus"):
            raise ValueError(f"unknown mode {mode!r}")
        return cls(processing=WholeBlock() if mode == "baseline" else DelayedCache(),
                   eviction=FocusEviction(kernels, mesh) if mode == "focus" else NoEviction(),
                   unmasking=UnmaskingRule(unmasking, per_step))
