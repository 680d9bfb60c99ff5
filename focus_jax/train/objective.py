"""The block-diffusion training objective.

Following Block Diffusion (Arriola et al., "Block Diffusion: Interpolating Between Autoregressive
and Diffusion Language Models", ICLR 2025), as SDAR trains (Cheng et al., "SDAR: A Synergistic
Diffusion-AutoRegression Paradigm", 2025), with the masked-diffusion ELBO weighting of MDLM
(Sahoo et al., "Simple and Effective Masked Diffusion Language Models", NeurIPS 2024):

* a sequence ``x`` of length ``L`` (a multiple of the block size ``B``) is split in blocks; every
  block ``b`` draws a noise level ``t_b ~ U(eps, 1]`` and each of its trainable tokens is replaced
  by the mask token with probability ``t_b``, giving ``x_t``;
* the model sees ``[x_t, x]`` (noisy copy, then clean copy; both with positions ``0..L-1``) under
  the block-diffusion mask: a noisy token of block ``b`` sees the noisy tokens of block ``b`` and
  the clean tokens of blocks ``< b``; a clean token of block ``b`` sees the clean tokens of blocks
  ``<= b`` (block-causal, as at inference, where they are the KV cache);
* the loss is the cross-entropy of the original token at each masked position of the noisy copy
  (the logit at a position predicts that position: no shift), weighted by ``1 / t_b``, summed
  and divided by the number of trainable tokens.

Only the response of a (prompt, response) pair is trainable: prompt tokens stay clean in the
noisy copy, as prompt slots of the active block stay unmasked at inference.

Our addition, ``truncate_prob``: with that probability a block's noisy tokens see the noisy
tokens of their block only up to a random cut-off slot (and only those up to it are scored).
Under FOCUS, retained tokens attend up to the rightmost retained slot (SPEC_FOCUS 5-6), so the
model meets such truncated blocks at inference; training on them keeps it from, for example,
repeating the last token of an answer whose end it can no longer see.

Also ours, ``stale_prob``: with that probability a block is trained with the views of the delayed
KV cache (SPEC_FOCUS 5). There a decoded token's KV is written once, in the step after it was
decoded, and then frozen while the tokens to its right are still masks, so later queries read
keys and values computed without the block's later tokens. In a stale block each unmasked noisy
token sees the noisy tokens of its block only up to the next slot; masked tokens (re-run every
step at inference) see the whole block. An approximation for left-to-right decoding: at
inference the frozen token also saw the mask tokens to its right (and any token decoded out of
order), which this view hides.

And ``delayed_prob``: with that probability a whole sequence is trained with the views of the
delayed KV cache, following its caching rule: in the noisy copy, the unmasked tokens the cache
would have frozen (the block's last slot, or a slot whose next slot is unmasked too) see their
block only up to the next slot, while a decoded token right before a mask (live at inference)
sees the whole block; in the clean copy, every token sees its block only up to the next slot.
The clean copy is the history of the next blocks, and under the delayed cache the history is
stale too: the commit step re-runs only the slots not yet frozen, so a committed block keeps
the keys and values its tokens were frozen with. (Hiding the slots beyond the next one is the
same left-to-right approximation as above.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from focus_jax.models.decoder import Decoder, forward_hidden


def within_cutoff(length: int, block_size: int,
                  cutoff: Int[Array, "... blocks"]) -> Bool[Array, "... l"]:
    """True for positions at or before their block's cut-off slot."""
    return jnp.arange(length) % block_size <= jnp.repeat(cutoff, block_size, axis=-1)


def block_diffusion_mask(length: int, block_size: int,
                         cutoff: Int[Array, "... blocks"] | None = None,
                         stale: Bool[Array, "... l"] | None = None,
                         stale_history: Bool[Array, "... l"] | None = None
                         ) -> Bool[Array, "... 2l 2l"]:
    """Attention mask over ``[noisy copy, clean copy]``: True where a query sees a key.

    ``cutoff`` (per block, optionally batched): noisy keys past that slot of their block are
    hidden from the block's noisy queries. ``stale`` (per position): these noisy queries see the
    noisy keys of their block only up to their own slot + 1. ``stale_history`` (per position):
    the same for these clean queries over the clean keys of their block.
    """
    block = jnp.arange(length) // block_size
    position = jnp.arange(length)
    beyond_next = position[None, :] > position[:, None] + 1

    def up_to_next_slot(part: Array, queries: Array | None) -> Array:
        # Keys right of the next slot in the same block (later blocks are hidden already).
        return part if queries is None else part & ~(queries[..., :, None] & beyond_next)

    noisy_to_noisy = block[:, None] == block[None, :]
    if cutoff is not None:
        noisy_to_noisy = noisy_to_noisy & within_cutoff(length, block_size, cutoff)[..., None, :]
    noisy_to_noisy = up_to_next_slot(noisy_to_noisy, stale)
    noisy_to_clean = block[None, :] < block[:, None]
    clean_to_clean = up_to_next_slot(block[None, :] <= block[:, None], stale_history)
    never = jnp.zeros((length, length), bool)
    batch = jnp.broadcast_shapes(noisy_to_noisy.shape[:-2], clean_to_clean.shape[:-2])

    def full(part: Array) -> Array:
        return jnp.broadcast_to(part, (*batch, length, length))

    top = jnp.concatenate([full(noisy_to_noisy), full(noisy_to_clean)], axis=-1)
    bottom = jnp.concatenate([full(never), full(clean_to_clean)], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def noise(tokens: Int[Array, "b l"], trainable: Bool[Array, "b l"], key: Array, block_size: int,
          mask_token_id: int, eps: float = 1e-3):
    """Mask trainable tokens at a per-block rate ``t``; returns ``(noisy, masked, t per token)``."""
    b, length = tokens.shape
    rate_key, token_key = jax.random.split(key)
    t = eps + (1 - eps) * jax.random.uniform(rate_key, (b, length // block_size))
    t = jnp.repeat(t, block_size, axis=1)
    masked = trainable & (jax.random.uniform(token_key, (b, length)) < t)
    return jnp.where(masked, mask_token_id, tokens), masked, t


def frozen_by_delayed_cache(noisy: Int[Array, "b l"], block_size: int,
                            mask_token_id: int) -> Bool[Array, "b l"]:
    """Unmasked slots that the delayed KV cache would have frozen (SPEC_FOCUS 5): the last slot
    of a block, or a slot whose next slot is unmasked too."""
    b, length = noisy.shape
    unmasked = (noisy != mask_token_id).reshape(b, length // block_size, block_size)
    next_unmasked = jnp.pad(unmasked[..., 1:], ((0, 0), (0, 0), (0, 1)), constant_values=True)
    return (unmasked & next_unmasked).reshape(b, length)


def loss(model: Decoder, tokens: Int[Array, "b l"], trainable: Bool[Array, "b l"], key: Array,
         block_size: int, mask_token_id: int, truncate_prob: float = 0.0, stale_prob: float = 0.0,
         delayed_prob: float = 0.0) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The block-diffusion loss of a batch, and metrics (masked-token accuracy, masked count)."""
    b, length = tokens.shape
    if length % block_size:
        raise ValueError(f"sequence length {length} must be a multiple of the block size")
    noise_key, cut_key, pick_key, stale_key = jax.random.split(key, 4)
    noisy, masked, t = noise(tokens, trainable, noise_key, block_size, mask_token_id)
    blocks = length // block_size
    cutoff = stale = stale_history = None
    if truncate_prob > 0:
        cutoff = jax.random.randint(cut_key, (b, blocks), 0, block_size)
        truncated = jax.random.uniform(pick_key, (b, blocks)) < truncate_prob
        cutoff = jnp.where(truncated, cutoff, block_size - 1)
        masked = masked & within_cutoff(length, block_size, cutoff)
    if stale_prob > 0:
        stale_block = jax.random.uniform(stale_key, (b, blocks)) < stale_prob
        stale = jnp.repeat(stale_block, block_size, axis=1) & (noisy != mask_token_id)
    if delayed_prob > 0:
        # Its own key, folded in, so that runs without the option keep their random streams.
        delayed = jax.random.uniform(jax.random.fold_in(key, 5), (b, 1)) < delayed_prob
        frozen = delayed & frozen_by_delayed_cache(noisy, block_size, mask_token_id)
        stale = frozen if stale is None else stale | frozen
        stale_history = jnp.broadcast_to(delayed, (b, length))
    mask = block_diffusion_mask(length, block_size, cutoff, stale, stale_history)
    inputs = jnp.concatenate([noisy, tokens], axis=1)
    positions = jnp.broadcast_to(jnp.tile(jnp.arange(length), 2), inputs.shape)
    hidden, _ = forward_hidden(model, inputs, positions, mask)
    logits = model.head(hidden[:, :length])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]
    weight = jnp.where(masked, 1.0 / t, 0.0)
    value = (nll * weight).sum() / jnp.maximum(trainable.sum(), 1)
    correct = (logits.argmax(-1) == tokens) & masked
    metrics = {"masked_accuracy": correct.sum() / jnp.maximum(masked.sum(), 1),
               "masked_tokens": masked.sum()}
    return value, metrics
