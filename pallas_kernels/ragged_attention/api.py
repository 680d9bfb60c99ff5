"""Dispatch for ragged attention: one entry point, the backend chosen by platform or ``impl``."""

from __future__ import annotations

import functools

from pallas_kernels.dispatch import choose
from pallas_kernels.ragged_attention import pallas_tpu, reference

IMPLS = {
    "xla": reference.ragged_attention,
    "pallas_tpu": pallas_tpu.ragged_attention,
    "pallas_tpu_interpret": functools.partial(pallas_tpu.ragged_attention, interpret=True),
}


def ragged_attention(*args, impl: str | None = None, **kwargs):
    """Ragged attention (contract in :mod:`pallas_kernels.ragged_attention.reference`).

    ``impl``: ``xla``, ``pallas_tpu``, ``pallas_tpu_interpret`` (the TPU kernel in the Pallas
    interpreter, any platform); ``None`` picks the platform default.
    """
    return choose("ragged_attention", IMPLS, impl)(*args, **kwargs)
