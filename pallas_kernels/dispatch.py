"""Choosing a kernel implementation: by platform, unless the caller names one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

PLATFORM_DEFAULT = {"tpu": "pallas_tpu"}
"""Platforms whose default is a kernel; every other platform (CPU, and GPU until its kernels are
measured to beat XLA) runs the XLA reference."""


def choose(op: str, impls: Mapping[str, Callable[..., Any]], impl: str | None) -> Callable[..., Any]:
    """The implementation named ``impl``, or the platform's default one."""
    name = impl or PLATFORM_DEFAULT.get(jax.default_backend(), "xla")
    if name not in impls:
        raise ValueError(f"{op}: unknown impl {name!r}; choose from {sorted(impls)}")
    return impls[name]
