"""Ragged attention over a slot-major KV cache: see ``reference`` for the contract."""

from pallas_kernels.ragged_attention.api import ragged_attention, ragged_attention_sharded

__all__ = ["ragged_attention", "ragged_attention_sharded"]
