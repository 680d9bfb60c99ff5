"""The loaded model: configuration, parameters and tokenizer, plus the uncached forward."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from focus_jax.config import ModelConfig
from focus_jax.models.decoder import Decoder, forward


@dataclasses.dataclass
class Model:
    """A decoder ready to run: ``config``, ``params`` (an NNX state pytree) and ``tokenizer``.

    ``graphdef`` and ``params`` are the two halves of ``nnx.split(decoder)``; jit-compiled code
    takes ``params`` as an argument and rebuilds the module with :meth:`module`.
    """

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Any = None
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_decoder(cls, decoder: Decoder, tokenizer: Any = None,
                     stop_token_ids: tuple[int, ...] = ()) -> Model:
        graphdef, params = nnx.split(decoder)
        return cls(decoder.config, graphdef, params, tokenizer, tuple(stop_token_ids))

    def module(self, params: nnx.State | None = None) -> Decoder:
        return nnx.merge(self.graphdef, self.params if params is None else params)

    @property
    def mask_token_id(self) -> int:
        if self.config.mask_token_id is not None:
            return self.config.mask_token_id
        token = getattr(self.tokenizer, "mask_token_id", None)
        if token is None:
            raise ValueError("the model has no mask token: set mask_token_id in config.json or "
                             "give the tokenizer a mask token")
        return int(token)

    def logits(self, token_ids: Int[Array, "b t"] | np.ndarray,
               block_size: int) -> Float[Array, "b t vocab"]:
        """Uncached block-causal forward: float32 logits for every position."""
        tokens = jnp.asarray(token_ids, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"token_ids must be [batch, length], got shape {tokens.shape}")
        return _logits(self.graphdef, self.params, tokens, block_size)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _logits(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array,
            block_size: int) -> jax.Array:
    logits, _ = forward(nnx.merge(graphdef, params), tokens, block_size)
    return logits
