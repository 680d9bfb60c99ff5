"""Dispatch for FOCUS importance: one entry point, the backend chosen by platform or ``impl``."""

from __future__ import annotations

import functools

from pallas_kernels.dispatch import choose
from pallas_kernels.focus_importance import pallas_tpu, reference


def _triton(*args, **kwargs):
    from pallas_kernels.focus_importance import triton_gpu  # needs triton and jax-triton: GPU only

    return triton_gpu.importance(*args, **kwargs)


IMPLS = {
    "xla": reference.importance,
    "pallas_tpu": pallas_tpu.importance,
    "pallas_tpu_interpret": functools.partial(pallas_tpu.importance, interpret=True),
    "triton": _triton,
}


def focus_importance(q, k, masked, *, impl: str | None = None):
    """FOCUS importance (contract in :func:`pallas_kernels.focus_importance.reference.importance`).

    ``impl``: ``xla``, ``pallas_tpu``, ``pallas_tpu_interpret``, ``triton`` (NVIDIA GPUs,
    through jax-triton); ``None`` picks the platform default.
    """
    return choose("focus_importance", IMPLS, impl)(q, k, masked)
