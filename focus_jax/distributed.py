"""Several processes, one program: TPU pods and multi-GPU hosts (and CPUs, for tests).

Every process runs the same host code on the same inputs; ``jax.distributed`` joins their
devices into one global mesh, and JAX's SPMD partitioner spreads each program over them. Host
reads of sharded arrays gather from all processes; only process 0 prints and writes results.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any

import jax
from jax.experimental import multihost_utils

from focus_jax.config import ConfigError

JOIN_TIMEOUT_SECONDS = 300.0
"""How long processes wait for each other by default (JAX's own default)."""


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               timeout_seconds: float = JOIN_TIMEOUT_SECONDS) -> None:
    """Join the processes of a run. On TPU pods and SLURM/Open MPI clusters JAX finds the
    arguments itself (call with none); elsewhere pass all three. CPU processes talk through
    gloo.

    Says on stderr what it waits for, and waits at most ``timeout_seconds`` for every process
    to join: past it, this process prints a one-line error and exits with code 2. (JAX's own
    timeout aborts the process from C++, which Python cannot catch: the deadline here comes
    first.) Bad arguments, or no coordinator listening, raise ``ConfigError``.
    """
    if not timeout_seconds > 0:
        raise ConfigError(f"--join-timeout must be > 0 seconds, got {timeout_seconds}")
    deadline = time.monotonic() + timeout_seconds
    if coordinator is not None:
        host, port = _check_arguments(coordinator, num_processes, process_id)
        waiting = (f"the other {num_processes - 1} process(es) to join at {coordinator}"
                   if process_id == 0 else
                   f"all {num_processes} processes to join at {coordinator} (process 0 there)")
        print(f"focus-jax: process {process_id} of {num_processes}: waiting up to "
              f"{timeout_seconds:g} s for {waiting}", file=sys.stderr, flush=True)
        if process_id != 0:
            _wait_for_listener(host, port, deadline, coordinator)
        give_up = (f"not all {num_processes} processes joined at {coordinator} within "
                   f"{timeout_seconds:g} s (this is process {process_id}): start each with the "
                   f"same --coordinator and --num-processes and its own --process-id "
                   f"0..{num_processes - 1}, or raise --join-timeout")
    else:
        print(f"focus-jax: waiting up to {timeout_seconds:g} s for the processes JAX finds "
              f"(TPU pod, SLURM, Open MPI) to join", file=sys.stderr, flush=True)
        give_up = (f"the processes did not join within {timeout_seconds:g} s: start the same "
                   f"command on every host of the slice or job, or raise --join-timeout")
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), _exit_with, (give_up,))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id,
                                   initialization_timeout=int(timeout_seconds) + 60)
    finally:
        watchdog.cancel()


def _check_arguments(coordinator: str, num_processes: int | None,
                     process_id: int | None) -> tuple[str, int]:
    """The coordinator's host and port, once the three arguments are known to fit together."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator {coordinator!r} must be HOST:PORT (e.g. 10.0.0.1:1234)")
    if num_processes is None or process_id is None:
        raise ConfigError("--coordinator needs --num-processes N and --process-id I (0..N-1)")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id must lie in 0..{num_processes - 1} and --num-processes "
                          f"be >= 1, got process {process_id} of {num_processes}")
    return host.strip("[]"), int(port)


def _wait_for_listener(host: str, port: int, deadline: float, coordinator: str) -> None:
    """Wait until something listens at ``host:port`` (process 0's coordinator), or raise."""
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise ConfigError(f"no coordinator answered at {coordinator}: start process 0 "
                                  f"(--process-id 0) with the same --coordinator, or check "
                                  f"the address") from None
            time.sleep(0.5)


def _exit_with(message: str) -> None:
    print(f"focus-jax: error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def is_primary() -> bool:
    """Process 0: the one that prints and writes."""
    return jax.process_index() == 0


def to_host(tree: Any) -> Any:
    """NumPy copies of (possibly sharded, possibly multi-process) arrays, whole on every host."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)
