"""Several processes, one program: TPU pods and multi-GPU hosts (and CPUs, for tests).

Every process runs the same host code on the same inputs; ``jax.distributed`` joins their
devices into one global mesh, and JAX's SPMD partitioner spreads each program over them. Host
reads of sharded arrays gather from all processes; only process 0 prints and writes results.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import multihost_utils


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join the processes of a run. On TPU pods and SLURM/Open MPI clusters JAX finds the
    arguments itself (call with none); elsewhere pass all three. CPU processes talk through
    gloo."""
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def is_primary() -> bool:
    """Process 0: the one that prints and writes."""
    return jax.process_index() == 0


def to_host(tree: Any) -> Any:
    """NumPy copies of (possibly sharded, possibly multi-process) arrays, whole on every host."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)
