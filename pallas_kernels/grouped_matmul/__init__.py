"""Grouped (ragged) matmul for mixture-of-experts layers: see ``reference`` for the contract."""

from pallas_kernels.grouped_matmul.api import grouped_matmul

__all__ = ["grouped_matmul"]
