"""Ragged attention over a paged KV cache: see ``reference`` for the contract."""

from pallas_kernels.paged_attention.api import paged_attention, paged_attention_sharded

__all__ = ["paged_attention", "paged_attention_sharded"]
