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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from focus_jax.models.qwen3 import Decoder, forward_hidden


def block_diffusion_mask(length: int, block_size: int) -> Bool[Array, "2l 2l"]:
    """Attention mask over ``[noisy copy, clean copy]``: True where a query sees a key."""
    block = jnp.arange(length) // block_size
    same = block[:, None] == block[None, :]
    before = block[None, :] < block[:, None]
    at_or_before = block[None, :] <= block[:, None]
    never = jnp.zeros((length, length), bool)
    top = jnp.concatenate([same, before], axis=1)          # noisy queries
    bottom = jnp.concatenate([never, at_or_before], axis=1)  # clean queries
    return jnp.concatenate([top, bottom], axis=0)


def noise(tokens: Int[Array, "b l"], trainable: Bool[Array, "b l"], key: Array, block_size: int,
          mask_token_id: int, eps: float = 1e-3):
    """Mask trainable tokens at a per-block rate ``t``; returns ``(noisy, masked, t per token)``."""
    b, length = tokens.shape
    rate_key, token_key = jax.random.split(key)
    t = eps + (1 - eps) * jax.random.uniform(rate_key, (b, length // block_size))
    t = jnp.repeat(t, block_size, axis=1)
    masked = trainable & (jax.random.uniform(token_key, (b, length)) < t)
    return jnp.where(masked, mask_token_id, tokens), masked, t


def loss(model: Decoder, tokens: Int[Array, "b l"], trainable: Bool[Array, "b l"], key: Array,
         block_size: int, mask_token_id: int) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The block-diffusion loss of a batch, and metrics (masked-token accuracy, masked count)."""
    length = tokens.shape[1]
    if length % block_size:
        raise ValueError(f"sequence length {length} must be a multiple of the block size")
    noisy, masked, t = noise(tokens, trainable, key, block_size, mask_token_id)
    inputs = jnp.concatenate([noisy, tokens], axis=1)
    positions = jnp.broadcast_to(jnp.tile(jnp.arange(length), 2), inputs.shape)
    hidden, _ = forward_hidden(model, inputs, positions, block_diffusion_mask(length, block_size))
    logits = model.head(hidden[:, :length])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]
    weight = jnp.where(masked, 1.0 / t, 0.0)
    value = (nll * weight).sum() / jnp.maximum(trainable.sum(), 1)
    correct = (logits.argmax(-1) == tokens) & masked
    metrics = {"masked_accuracy": correct.sum() / jnp.maximum(masked.sum(), 1),
               "masked_tokens": masked.sum()}
    return value, metrics
