"""Choosing a kernel implementation: by platform, unless the caller names one."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

PLATFORM_DEFAULT = {
    "ragged_attention": {"tpu": "pallas_tpu", "gpu": "triton"},
    "focus_importance": {"tpu": "pallas_tpu", "gpu": "xla"},
    "paged_attention": {"tpu": "pallas_tpu", "gpu": "triton"},
}
"""Per op, the platforms whose default is a kernel; other platforms (the CPU) run the XLA
reference. GPU defaults are what measured fastest on the H200 (docs/kernels.md)."""


RUNS_ON = {"xla": None, "pallas_tpu_interpret": None, "pallas_triton_interpret": None,
           "pallas_tpu": "tpu", "triton": "gpu", "pallas_triton": "gpu"}
"""Every implementation name, and the one platform it compiles for (None: any)."""


def target_platform() -> str:
    """The platform the code being traced is for: that of the abstract mesh in context (a TPU
    topology's, when compiling for a TPU on this CPU: DESIGN.md section 11), else the default
    backend's (``cpu``, ``gpu``, ``tpu``)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def unusable(impl: str, platform: str) -> str | None:
    """Why implementation ``impl`` cannot run on devices of ``platform`` (None: it can)."""
    if impl not in RUNS_ON:
        return f"unknown kernels {impl!r}: choose from {', '.join(RUNS_ON)}"
    needs = RUNS_ON[impl]
    if needs is not None and needs != platform:
        return (f"kernels {impl!r} run only on {needs.upper()}s, not on this {platform.upper()} "
                f"(xla runs anywhere)")
    return None


@functools.cache
def _jax_triton_installed() -> bool:
    return importlib.util.find_spec("jax_triton") is not None


def default_impl(op: str) -> str:
    """The platform's default implementation of ``op`` (GPUs without jax-triton: XLA)."""
    name = PLATFORM_DEFAULT[op].get(jax.default_backend(), "xla")
    if name == "triton" and not _jax_triton_installed():
        warnings.warn("jax-triton is not installed: the GPU runs the XLA attention and importance "
                      "(pip install 'focus-jax[gpu]' for the Triton kernels)", stacklevel=3)
        return "xla"
    return name


def implementations(package: str, function: str) -> dict[str, Callable[..., Any]]:
    """Every backend of one op: each of ``package``'s modules ``reference`` (the XLA path),
    ``pallas_tpu``, ``triton_gpu`` and, where there is one, ``pallas_triton`` defines
    ``function``. The jax-triton module is imported on first call (it needs triton and
    jax-triton, which only GPU installs have)."""
    def load(module: str) -> Callable[..., Any]:
        return getattr(importlib.import_module(f"{package}.{module}"), function)

    def triton(*args: Any, **kwargs: Any) -> Any:
        return load("triton_gpu")(*args, **kwargs)

    impls = {"xla": load("reference"), "pallas_tpu": load("pallas_tpu"),
             "pallas_tpu_interpret": functools.partial(load("pallas_tpu"), interpret=True),
             "triton": triton}
    if importlib.util.find_spec(f"{package}.pallas_triton") is not None:
        # Pallas's Triton backend (NVIDIA GPUs), and the same kernel in the interpreter.
        impls["pallas_triton"] = load("pallas_triton")
        impls["pallas_triton_interpret"] = functools.partial(load("pallas_triton"),
                                                             interpret=True)
    return impls


def choose(op: str, impls: Mapping[str, Callable[..., Any]], impl: str | None) -> Callable[..., Any]:
    """The implementation named ``impl``, or the platform's default one (also for a known
    implementation name this op has no kernel of)."""
    name = impl or default_impl(op)
    if name in RUNS_ON and name not in impls:
        # A known implementation this op has no kernel of (FOCUS importance has no Pallas Triton
        # one): the op runs its platform's default beside the ops that have it.
        name = default_impl(op)
    if name not in impls:
        raise ValueError(f"{op}: unknown impl {name!r}; choose from {sorted(impls)}")
    return impls[name]
