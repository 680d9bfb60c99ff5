"""Dispatch for ragged attention: one entry point, the backend chosen by platform or ``impl``."""

from __future__ import annotations

import functools

from pallas_kernels.dispatch import choose
from pallas_kernels.ragged_attention import pallas_tpu, reference


def _triton(*args, **kwargs):
    from pallas_kernels.ragged_attention import triton_gpu  # needs triton and jax-triton: GPU only

    return triton_gpu.ragged_attention(*args, **kwargs)


IMPLS = {
    "xla": reference.ragged_attention,
    "pallas_tpu": pallas_tpu.ragged_attention,
    "pallas_tpu_interpret": functools.partial(pallas_tpu.ragged_attention, interpret=True),
    "triton": _triton,
}


def ragged_attention(*args, impl: str | None = None, **kwargs):
    """Ragged attention (contract in :mod:`pallas_kernels.ragged_attention.reference`).

    ``impl``: ``xla``, ``pallas_tpu``, ``pallas_tpu_interpret`` (the TPU kernel in the Pallas
    interpreter, any platform), ``triton`` (NVIDIA GPUs, through jax-triton); ``None`` picks
    the platform default.
    """
    return choose("ragged_attention", IMPLS, impl)(*args, **kwargs)
