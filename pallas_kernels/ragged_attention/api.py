"""Dispatch for ragged attention: one entry point, the backend chosen by platform or ``impl``."""

from __future__ import annotations

from pallas_kernels.dispatch import choose, implementations

IMPLS = implementations("pallas_kernels.ragged_attention", "ragged_attention")


def ragged_attention(*args, impl: str | None = None, **kwargs):
    """Ragged attention (contract in :mod:`pallas_kernels.ragged_attention.reference`).

    ``impl``: ``xla``, ``pallas_tpu``, ``pallas_tpu_interpret`` (the TPU kernel in the Pallas
    interpreter, any platform), ``triton`` (NVIDIA GPUs, through jax-triton); ``None`` picks
    the platform default.
    """
    return choose("ragged_attention", IMPLS, impl)(*args, **kwargs)
