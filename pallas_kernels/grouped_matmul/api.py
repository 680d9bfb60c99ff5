"""Dispatch for the grouped matmul: one entry point, the backend chosen by platform, dtype and
installed packages, or named by ``impl``.

Its implementations are its own (``xla``, ``tokamax``), not the engine-wide ``kernels`` names
of :mod:`pallas_kernels.dispatch`, which choose the attention and importance kernels.
"""

from __future__ import annotations

import functools
import logging
import warnings

import jax.numpy as jnp
import qwix
from jaxtyping import Array, Float, Int

from pallas_kernels.dispatch import target_platform
from pallas_kernels.grouped_matmul import tokamax_mosaic, xla

IMPLS = ("xla", "tokamax")
"""``xla``: ``jax.lax.ragged_dot``, any platform. ``tokamax``: tokamax's Mosaic kernels, NVIDIA
Hopper GPUs and TPUs from v5 on (:mod:`pallas_kernels.grouped_matmul.tokamax_mosaic`)."""

log = logging.getLogger(__name__)
XLA_SLOWDOWN = "5 to 40 times slower than tokamax's kernel on an H200"
"""What falling back to XLA's ragged dot costs (docs/kernels.md), for the warnings."""


def grouped_matmul(lhs: Float[Array, "m k"], rhs: Float[Array, "g k n"] | qwix.QArray,
                   group_sizes: Int[Array, "g"], *, impl: str | None = None,
                   preferred_element_type: jnp.dtype | None = None) -> Float[Array, "m n"]:
    """Rows of ``lhs`` sorted by group times their group's ``rhs``: the mixture-of-experts
    matmul (contract in :func:`pallas_kernels.grouped_matmul.reference.grouped_matmul`).

    Rows ``[sum(group_sizes[:i]), sum(group_sizes[:i + 1]))`` multiply ``rhs[i]``; groups may
    be empty; rows at or past ``sum(group_sizes)`` (which must not exceed ``m``) are padding
    and come out as zeros from every backend. The result has ``preferred_element_type``
    (default: the inputs' promoted dtype). ``rhs`` may be a qwix ``QArray`` (8-bit weights with
    a scale per output channel, in the dtype of ``lhs``): tokamax's kernels dequantize it in
    the kernel (Hopper: its weight-only kernel), XLA's ragged dot through qwix.

    ``impl``: ``xla`` or ``tokamax``; ``None`` picks tokamax's kernel on Hopper GPUs (bf16 or
    f16, ``k`` and ``n`` multiples of 64) and TPUs (bf16) where tokamax is installed, else
    XLA's ragged dot (with a warning, once, when only the missing tokamax stands in the way).
    A named ``impl`` that cannot run here is a ``ValueError`` that says why.
    """
    _check_shapes(lhs, rhs, group_sizes)
    platform = target_platform()
    if impl is None:
        impl = _default(lhs, rhs, platform)
    elif impl not in IMPLS:
        raise ValueError(f"grouped_matmul: unknown impl {impl!r}; choose from {', '.join(IMPLS)}")
    elif impl == "tokamax" and (why := tokamax_mosaic.unsupported(lhs, rhs, platform)):
        raise ValueError(f"grouped_matmul impl='tokamax' cannot run here: {why} (impl='xla' runs "
                         f"anywhere)")
    if impl == "tokamax":
        return tokamax_mosaic.grouped_matmul(lhs, rhs, group_sizes, platform=platform,
                                             preferred_element_type=preferred_element_type)
    return xla.grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


def _check_shapes(lhs: Array, rhs: Array, group_sizes: Array) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != rhs.shape[:1]:
        raise ValueError(f"grouped_matmul takes lhs [m, k], rhs [g, k, n] and group_sizes [g]; got "
                         f"{lhs.shape}, {rhs.shape} and {group_sizes.shape}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul: lhs [m, k={lhs.shape[1]}] does not contract with "
                         f"rhs [g, k={rhs.shape[1]}, n]")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes must be integers, not {group_sizes.dtype}")


def _default(lhs: Array, rhs: Array, platform: str) -> str:
    """tokamax where its kernel runs, else ``xla``."""
    if platform not in tokamax_mosaic.KERNEL:
        return "xla"
    why = tokamax_mosaic.unsupported(lhs, rhs, platform)
    if why is None:
        return "tokamax"
    if not tokamax_mosaic.installed():
        _warn_once(f"tokamax is not installed: the {platform.upper()} runs XLA's grouped matmul, "
                   f"{XLA_SLOWDOWN} (pip install 'focus-jax[{platform}]')")
    elif isinstance(rhs, qwix.QArray):  # quantized experts lose the fast kernel: say so
        _warn_once(f"8-bit experts run XLA's grouped matmul, {XLA_SLOWDOWN}: {why}")
    else:
        _log_once(f"grouped_matmul runs XLA's ragged dot: {why}")
    return "xla"


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)
