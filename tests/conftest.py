"""Shared fixtures: tiny models built once per session."""

import os
from pathlib import Path

# Tests run on the CPU, in float32, with exact float32 matmuls, whatever machine runs them (with
# libtpu installed, JAX would otherwise look for a TPU first). Compiles for TPU topologies load
# libtpu, whose lock file would refuse a second process using it at the same time.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

from focus_jax.testing import tiny_model, xla_flags  # noqa: E402

# Before any backend starts; inherited by the tests' subprocesses (focus_jax.testing.TEST_XLA_FLAGS).
os.environ["XLA_FLAGS"] = xla_flags(base=os.environ.get("XLA_FLAGS", ""))


@pytest.fixture(scope="session")
def model():
    """A tiny random float32 model with sharp enough distributions that steps decode several
    tokens at once at moderate thresholds."""
    return tiny_model(seed=0, scale=4.0, tokenizer=True)


SLOWEST_FIRST = ("test_sharding.py", "test_compilation.py", "test_moe_decoding.py", "test_paged.py",
                 "test_compile_check.py", "test_serve.py", "test_kernels.py", "test_lifecycle.py",
                 "test_quantization.py", "test_decoding.py", "test_cli.py", "test_focus.py",
                 # The rest of 10 s or more, longest first (a cold make test, 2026-12-07).
                 "test_inputs.py", "test_serve_notebook.py", "test_training.py",
                 "test_tpu_kernels.py", "test_readme.py", "test_train_cli.py",
                 "test_grouped_matmul.py", "test_checkpoints.py", "test_evaluate.py",
                 "test_sharded_kernels.py", "test_install.py", "test_parity_moe.py",
                 "test_parity_llada2.py")
"""Files whose tests start first, slowest first: with ``pytest -n 2 --dist loadfile
--no-loadscope-reorder`` (make test) each worker takes the next file in this order, so the
8-device subprocess of test_sharding.py (the longest file) runs beside the rest instead of alone
at the end (and the TPU compiles of test_compile_check.py mostly after it: beside it, on two
cores, the file ran about 40 s longer), and the run ends on files of a few seconds, not on one of
the 35-50 s files (the notebook, the README) that the alphabetical order left last. (xdist's
default order, most tests first, started test_sharding.py, which has few tests, after two thirds
of the run.)"""


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# ------------------------------------------------------------------ where the suite's time goes
COMPILE_REPORT_ENV = "FOCUS_JAX_TEST_COMPILE_REPORT"
"""With this set to a folder, each test process appends one JSON line per test there: its backend
compiles (count, seconds) in this process, and its wall seconds (subprocesses not counted)."""


@pytest.fixture(autouse=True)
def _compile_report(request):
    folder = os.environ.get(COMPILE_REPORT_ENV)
    if not folder:
        yield
        return
    import json
    import time

    from focus_jax.compilation import BACKEND_COMPILE

    seconds = []
    _listeners.append(lambda event, duration: event == BACKEND_COMPILE and seconds.append(duration))
    start = time.perf_counter()
    try:
        yield
    finally:
        _listeners.pop()
        row = {"test": request.node.nodeid, "wall_s": round(time.perf_counter() - start, 2),
               "compiles": len(seconds), "compile_s": round(sum(seconds), 2)}
        path = Path(folder) / f"{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


_listeners: list = []


def _on_duration(event: str, duration: float, **kwargs) -> None:
    for listener in _listeners:
        listener(event, duration)


if os.environ.get(COMPILE_REPORT_ENV):
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_on_duration)
