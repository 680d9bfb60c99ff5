"""With libtpu installed on a host without TPU chips, commands print no libtpu initialisation
errors (focus_jax keeps JAX from starting its TPU backend there). Subprocesses: JAX_PLATFORMS is
unset in them, as for a user, where the tests' conftest sets it to cpu."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from focus_jax import tpu

REPO = Path(__file__).resolve().parents[1]
# What libtpu prints when it starts without a TPU (libtpu 0.0.48.1).
LIBTPU_ERRORS = ("Failed to find host bounds", "unexpected worker hostname",
                 "Source Location Trace", "TPU_ACCELERATOR_TYPE")


def tpu_chips() -> int:
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0]


pytestmark = [
    pytest.mark.skipif(not tpu.libtpu_installed(), reason="libtpu is not installed"),
    pytest.mark.skipif(tpu_chips() > 0, reason="this host has TPU chips"),
]


def user_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return {**env, "FOCUS_JAX_CACHE_DIR": str(tmp_path / "xla")}


def test_generate_prints_no_libtpu_errors_without_a_tpu(tmp_path):
    command = [sys.executable, "-m", "focus_jax.cli", "generate", "--prompt", "hi",
               "--max-new-tokens", "8", "--bucket-ladder", "0.5,1"]
    done = subprocess.run(command, cwd=REPO, env=user_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert not [line for line in LIBTPU_ERRORS if line in done.stderr], done.stderr


# compile-check prints its table and nothing from libtpu: in tests/test_compile_check.py
# (test_the_compile_check_command_prints_its_table_and_nothing_else_and_leaves_the_cache_alone),
# whose two runs of the command check the persistent cache too.
