"""Dispatch for ragged attention: one entry point, the backend chosen by platform or ``impl``."""

from __future__ import annotations

from typing import Literal

from pallas_kernels.ragged_attention import reference

Impl = Literal["xla"]
IMPLS: dict[str, object] = {"xla": reference.ragged_attention}


def ragged_attention(*args, impl: Impl | None = None, **kwargs):
    """Ragged attention (contract in :mod:`pallas_kernels.ragged_attention.reference`).

    ``impl``: ``None`` picks the platform default.
    """
    chosen = impl or "xla"
    if chosen not in IMPLS:
        raise ValueError(f"ragged_attention impl {chosen!r} unknown; choose from {sorted(IMPLS)}")
    return IMPLS[chosen](*args, **kwargs)
