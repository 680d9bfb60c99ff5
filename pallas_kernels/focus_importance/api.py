"""Dispatch for FOCUS importance: one entry point, the backend chosen by platform or ``impl``."""

from __future__ import annotations

from pallas_kernels.dispatch import choose, implementations

IMPLS = implementations("pallas_kernels.focus_importance", "importance")


def focus_importance(q, k, masked, *, impl: str | None = None):
    """FOCUS importance (contract in :func:`pallas_kernels.focus_importance.reference.importance`).

    ``impl``: ``xla``, ``pallas_tpu``, ``pallas_tpu_interpret``, ``triton`` (NVIDIA GPUs,
    through jax-triton); ``None`` picks the platform default.
    """
    return choose("focus_importance", IMPLS, impl)(q, k, masked)
