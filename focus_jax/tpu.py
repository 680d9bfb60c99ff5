"""TPU targets on a machine without a TPU: topology devices, meshes over them, and compiles.

With libtpu installed (``pip install 'focus-jax[tpu]'``), XLA and Mosaic compile for any TPU
topology on a CPU-only machine: :func:`devices` gives a topology's devices, :func:`make_mesh` a
``("data", "model")`` mesh over them, and :func:`compile_program` lowers a jitted function for
abstract inputs placed on that mesh, compiles it with the real TPU compilers and returns the
compile time and the memory each chip needs. Nothing runs: these devices have no memory of their
own and execute nothing.

Topologies are named as libtpu names them: ``v5e:2x4`` (8 chips), ``v6e:2x2``, ``v5p:2x2x1``.
libtpu gives no topology smaller than one host (``v5e:1x1`` is refused), so ``v5e:1x1`` (one
chip) is served by the first chip of the host topology ``v5e:2x2``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from focus_jax import compilation, sharding
from focus_jax.config import ConfigError

GIB = 2**30
INSTALL_HINT = "pip install 'focus-jax[tpu]'"


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation, as the compiler sees it."""

    generation: str
    """As in topology names: ``v5e``, ``v6e``, ``v5p``."""
    device_kind: str
    """``jax.Device.device_kind`` of its chips."""
    hbm_bytes: int
    """HBM per chip that the TPU compiler lets a program use (a little under the nominal 16, 32
    and 95 GB: the runtime keeps some)."""
    host_topology: str
    """The smallest topology libtpu gives (one host), where a single chip is taken from."""
    dims: int
    """Dimensions of its topologies (2-D torus for v5e and v6e, 3-D for v5p)."""
    accelerator_type: str
    """Its host topology as Cloud TPU names it (``TPU_ACCELERATOR_TYPE``)."""


# HBM per chip from libtpu 0.0.48.1's own out-of-memory message ("exceeds available HBM
# (15.75G)"), measured by compiling a 600 GiB program for one chip of each generation.
CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", "TPU v5 lite", round(15.75 * GIB), "v5e:2x2", 2, "v5litepod-4"),
    "v6e": Chip("v6e", "TPU v6 lite", round(31.24 * GIB), "v6e:2x2", 2, "v6e-4"),
    "v5p": Chip("v5p", "TPU v5", round(95.73 * GIB), "v5p:2x2x1", 3, "v5p-8"),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice by its libtpu name: ``v5e:2x4`` is 8 v5e chips in a 2 x 4 torus."""

    name: str
    chip: Chip
    shape: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)


def parse_topology(name: str) -> Topology:
    """``"v5e:2x4"`` -> its chip generation and shape; a ``ConfigError`` for names that are not
    a known generation and a shape of the generation's dimensions. Needs no libtpu."""
    match = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)*)", name.strip())
    examples = "v5e:1x1, v5e:2x4, v6e:2x4, v5p:2x2x1"
    if not match:
        raise ConfigError(f"bad topology {name!r}: expected GENERATION:SHAPE, e.g. {examples}")
    generation, shape_text = match.groups()
    if generation not in CHIPS:
        raise ConfigError(f"unknown TPU generation {generation!r} in {name!r}: choose from "
                          f"{', '.join(CHIPS)}")
    chip = CHIPS[generation]
    shape = tuple(int(n) for n in shape_text.split("x"))
    if len(shape) != chip.dims or min(shape) < 1:
        raise ConfigError(f"bad topology {name!r}: a {generation} shape has {chip.dims} "
                          f"positive dimensions, e.g. {chip.host_topology}")
    return Topology(f"{generation}:{shape_text}", chip, shape)


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def skip_absent_tpu() -> None:
    """Keep JAX from starting its TPU backend in this process when the host has no TPU chip.

    With libtpu installed (compile-check needs it), JAX tries its TPU backend first whenever it
    picks the backends itself; on a host without TPU chips JAX drops it quietly, but libtpu
    first prints pages of initialisation errors to stderr. When the process names no platforms
    (``JAX_PLATFORMS``, ``jax_platforms``), the backends are not started yet and the PCI bus
    shows no TPU chip, the TPU backend's factory is replaced by one that refuses, as quietly as
    JAX drops a failed TPU backend. "tpu" stays a known platform: Pallas TPU lowerings register
    and compile-check's topologies (which load libtpu on their own) work as before.
    ``JAX_PLATFORMS=tpu`` starts the TPU backend whatever the PCI bus says. This reads JAX
    internals; if they change, it does nothing (libtpu prints its errors again).
    """
    if os.environ.get("JAX_PLATFORMS") or not libtpu_installed():
        return
    try:
        from jax._src import hardware_utils, xla_bridge

        if (jax.config.jax_platforms or xla_bridge.backends_are_initialized()
                or "tpu" not in xla_bridge._backend_factories
                or hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0):
            return
        priority = xla_bridge._backend_factories["tpu"].priority
        xla_bridge.register_backend_factory("tpu", _no_tpu_chip, priority=priority,
                                            fail_quietly=True)
    except (ImportError, AttributeError, TypeError, OSError, RuntimeError):
        return


def _no_tpu_chip() -> None:
    raise RuntimeError("this host has no TPU chip (set JAX_PLATFORMS=tpu to start libtpu anyway)")


def require_libtpu() -> None:
    """A ``ConfigError`` that says how to install libtpu, when it is missing."""
    if not libtpu_installed():
        raise ConfigError(f"compiling for a TPU needs libtpu, which is not installed: "
                          f"{INSTALL_HINT}")


def devices(topology: Topology) -> list[jax.Device]:
    """The topology's chips as compile-only devices (one chip: the first of its host)."""
    require_libtpu()
    from jax.experimental import topologies

    # libtpu starts by asking the cloud's metadata server what this host is; off a TPU VM it
    # prints three warnings and an "E0000 ... INVALID_ARGUMENT" line (worker hostnames) on
    # stderr, in the middle of compile-check's table. Told, it asks nothing (the topology's
    # devices and compiles are the same: docs/startup.md, "Quiet by default"; the quiet table
    # is tested in tests/test_compile_check.py).
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology.chip.accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    single = topology.chips == 1
    name = topology.chip.host_topology if single else topology.name
    try:
        found = topologies.get_topology_desc(platform="tpu", topology_name=name).devices
    except Exception as err:  # libtpu's errors are runtime errors of many kinds
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "lockfile" in message:
            raise ConfigError("libtpu is in use by another process: set "
                              "ALLOW_MULTIPLE_LIBTPU_LOAD=1 to compile alongside it") from None
        raise ConfigError(f"libtpu does not know topology {topology.name!r}: {message}") from None
    return list(found[:1] if single else found)


def make_mesh(topology: Topology, data: int, model: int, expert: int = 1) -> Mesh:
    """A ``("data", "expert", "model")`` mesh over the topology's chips, in the order the engine
    takes devices (the first ``data * expert * model``)."""
    if data * expert * model > topology.chips:
        raise ConfigError(f"mesh data={data},expert={expert},model={model} needs "
                          f"{data * expert * model} chips, {topology.name} has {topology.chips}")
    return sharding.make_mesh(data, model, devices(topology), expert=expert)


def abstract(tree: Any, shardings: Any) -> Any:
    """Shapes and dtypes of ``tree`` (arrays, ``ShapeDtypeStruct``s, NNX variables holding
    either) placed with ``shardings`` (a matching tree of ``NamedSharding``): the inputs of a
    compile, nothing allocated."""
    def place(leaf: Any, where: NamedSharding) -> Any:
        shape = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where)
        return leaf.replace(shape) if isinstance(leaf, nnx.Variable) else shape

    return jax.tree.map(place, tree, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclasses.dataclass(frozen=True)
class ChipMemory:
    """Memory one chip needs for a compiled program (bytes), from XLA's memory analysis."""

    arguments: int
    temporaries: int
    outputs: int
    """Outputs that do not reuse a donated argument's buffer."""
    code: int

    @property
    def total(self) -> int:
        return self.arguments + self.temporaries + self.outputs + self.code

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> ChipMemory:
        stats = compiled.memory_analysis()
        return cls(arguments=stats.argument_size_in_bytes,
                   temporaries=stats.temp_size_in_bytes,
                   outputs=stats.output_size_in_bytes - stats.alias_size_in_bytes,
                   code=stats.generated_code_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """A compile for a TPU: its wall time, and the chip memory or the compiler's error."""

    seconds: float
    cpu_seconds: float
    """CPU time of this process during the compile (all its threads): on a shared machine a
    steadier measure than the wall time."""
    memory: ChipMemory | None
    error: str | None = None

    @property
    def compiled(self) -> bool:
        return self.error is None

    @property
    def out_of_memory(self) -> bool:
        """The compiler refused the program because it does not fit the chip's HBM."""
        return self.error is not None and "RESOURCE_EXHAUSTED" in self.error


def compile_program(mesh: Mesh, jitted: Callable[..., Any], *args: Any,
                    **static: Any) -> CompileResult:
    """Lower ``jitted`` for ``args`` (static values, and abstract inputs on ``mesh``'s devices)
    and the static keyword arguments ``static``, and compile it; errors become a one-line
    message, never an exception. Nothing is written to the persistent compilation cache
    (:func:`focus_jax.compilation.not_persisted`).

    Lowering runs under ``mesh``'s abstract mesh: some Pallas TPU lowering rules ask the
    current mesh for the chip generation (the default device here is a CPU).
    """
    start, cpu_start = time.perf_counter(), time.process_time()
    memory, error = None, None
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), compilation.not_persisted():
            compiled = jitted.lower(*args, **static).compile()
        memory = ChipMemory.of(compiled)
    except Exception as err:  # any compiler error is a result to report
        error = one_line(err)
    return CompileResult(time.perf_counter() - start, time.process_time() - cpu_start, memory,
                         error)


def one_line(err: BaseException, limit: int = 300) -> str:
    """The first line of an error that says something (XLA's messages run to pages)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[:limit - 3] + "..."
