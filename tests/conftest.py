"""Shared fixtures: tiny models built once per session."""

import os

# Tests run on the CPU, in float32, with exact float32 matmuls, whatever machine runs them (with
# libtpu installed, JAX would otherwise look for a TPU first). Compiles for TPU topologies load
# libtpu, whose lock file would refuse a second process using it at the same time.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

from focus_jax.testing import tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def model():
    """A tiny random float32 model with sharp enough distributions that steps decode several
    tokens at once at moderate thresholds."""
    return tiny_model(seed=0, scale=4.0, tokenizer=True)


SLOWEST_FIRST = ("test_sharding.py",)
"""Files whose tests start first: with ``pytest -n 2`` (make test) the 8-device subprocess of
test_sharding.py (about 5 minutes) then runs beside the rest instead of alone at the end."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in SLOWEST_FIRST)
