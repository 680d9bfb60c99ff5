"""``focus-jax compile-check``: compile, on this machine, every program a TPU slice would run.

Before paying for a pod slice: the prefill programs (one per prompt-length bucket) and the decode
round the engine would compile there, for that topology and mesh, with abstract weights and an
abstract decode state (shapes only, nothing allocated), through the real TPU compilers
(:mod:`focus_jax.tpu`). Per program: compiled or the compiler's error, compile time, HBM per
chip against the chip's capacity, and model FLOPs from the shapes (XLA's cost analysis counts a
Mosaic kernel as 0 FLOPs and a loop body once, so it cannot be used).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from focus_jax import compilation, decoding, sharding, tpu
from focus_jax.bench import layer_flops_per_token
from focus_jax.cache import PagedCache
from focus_jax.config import ConfigError, GenerationConfig, ModelConfig, Quantization
from focus_jax.engine.core import decode_settings
from focus_jax.engine.params import slot_params_rows
from focus_jax.engine.runner import (
    default_prefill_batch,
    default_prefill_chunk,
    prefill_buckets,
    prefill_rows,
    slot_positions,
)
from focus_jax.models.weights import abstract_decoder
from pallas_kernels.dispatch import PLATFORM_DEFAULT

# The kernels a TPU runs by default (both ops default to their Pallas TPU kernel). Named here:
# on this machine the platform default would be the CPU's.
TPU_KERNELS = "pallas_tpu"
assert {defaults["tpu"] for defaults in PLATFORM_DEFAULT.values()} == {TPU_KERNELS}


@dataclasses.dataclass(frozen=True)
class Target:
    """What to compile: a model on a TPU slice, with the engine's batch, cache and settings."""

    cfg: ModelConfig
    topology: tpu.Topology
    data: int
    model: int
    slots: int
    positions: int
    """Cache positions per slot (a multiple of the block size)."""
    generation: GenerationConfig
    prompt_buckets: tuple[int, ...]
    """Prompt lengths prefill is compiled for (the engine's buckets up to its prefill chunk)."""
    prefill_batch: int
    hbm_bytes: int
    """What a program may use per chip."""
    expert: int = 1
    """The mesh's expert axis (a mixture's experts split over it)."""
    chunk_buckets: tuple[int, ...] = ()
    """The ``computed`` lengths of longer prompts' chunks (one row each: the prefill after a
    cached prefix, :meth:`focus_jax.engine.runner.Runner.prefill`)."""

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """Sizes of the mesh axes, in :data:`focus_jax.sharding.AXES` order."""
        return self.data, self.expert, self.model

    @property
    def chips(self) -> int:
        return self.data * self.expert * self.model

    @property
    def block_size(self) -> int:
        return self.generation.block_size or self.cfg.block_size

    @property
    def kernels(self) -> str:
        return self.generation.kernels or TPU_KERNELS

    @property
    def pages(self) -> int | None:
        """A paged KV cache's pages (``kv_pages``, else as many as ``kv_cache_memory`` bytes
        per chip hold on each data shard, else as many as the contiguous cache's positions);
        None: contiguous."""
        generation, cfg = self.generation, self.cfg
        if generation.kv_cache != "paged":
            return None
        if generation.kv_pages is not None:
            return generation.kv_pages
        if generation.kv_cache_memory is not None:
            page_bytes = PagedCache.page_bytes(cfg, self.block_size, self.model)
            return max(1, generation.kv_cache_memory // page_bytes) * self.data
        return self.slots * self.positions // self.block_size


def make_target(cfg: ModelConfig, topology: str, *, slots: int, positions: int,
                generation: GenerationConfig, mesh: str | None = None,
                prompt_lengths: Sequence[int] | None = None, prefill_batch: int | None = None,
                hbm_gib: float | None = None) -> Target:
    """Check every option (cheaply: nothing is compiled) and return the target.

    ``mesh``: ``"data=2,model=4"`` or ``"data=2,expert=4"`` (required when the topology has
    more than one chip);
    ``prompt_lengths``: compile prefill at the buckets of these lengths (``None``: at every
    bucket the engine has; empty: none); ``hbm_gib``: the HBM a program may use per chip
    (default: the chip's).
    """
    slice_ = tpu.parse_topology(topology)
    if mesh is None and slice_.chips > 1:
        raise ConfigError(f"{slice_.name} has {slice_.chips} chips: give --mesh data=D,model=M "
                          f"(D x M chips; data=1,model=1 for one of them)")
    sizes = sharding.parse_mesh(mesh) if mesh else {"data": 1, "expert": 1, "model": 1}
    chips = sizes["data"] * sizes["expert"] * sizes["model"]
    if chips > slice_.chips:
        raise ConfigError(f"mesh {mesh} needs {chips} chips, {slice_.name} has {slice_.chips}")
    block = generation.block_size or cfg.block_size
    if block is None:
        raise ConfigError("the model's config.json names no block_size: give --block-size")
    if slots < 1 or positions < block:
        raise ConfigError(f"need at least one slot and one block of cache positions, got "
                          f"batch {slots} and max-len {positions}")
    sharding.check_divisible(cfg, sizes, slots)
    positions = slot_positions(block, positions)
    if prompt_lengths is not None:
        too_long = [n for n in prompt_lengths if not 1 <= n <= positions]
        if too_long:
            raise ConfigError(f"prompt lengths {too_long} do not fit a cache of {positions} "
                              f"positions")
    buckets, chunks = prefill_buckets(block, positions, prompt_lengths,
                                      default_prefill_chunk(block))
    if prefill_batch is not None and prefill_batch < 1:
        raise ConfigError(f"--prefill-batch must be >= 1, got {prefill_batch}")
    if hbm_gib is not None and hbm_gib <= 0:
        raise ConfigError(f"--hbm-gib must be positive, got {hbm_gib}")
    if (generation.kv_cache == "paged" and generation.kv_pages is not None
            and generation.kv_pages % sizes["data"]):
        raise ConfigError(f"kv_pages={generation.kv_pages} does not split evenly over the mesh's "
                          f"{sizes['data']} data shards: give a multiple of {sizes['data']}")
    if generation.kernels not in (None, "xla", TPU_KERNELS):
        raise ConfigError(f"kernels {generation.kernels!r} do not run on a TPU: use xla or "
                          f"{TPU_KERNELS}")
    return Target(cfg, slice_, sizes["data"], sizes["model"], slots, positions,
                  generation.replace(block_size=block), buckets,
                  prefill_batch or default_prefill_batch(slots, "tpu"),
                  round(hbm_gib * tpu.GIB) if hbm_gib else slice_.chip.hbm_bytes,
                  expert=sizes["expert"], chunk_buckets=chunks)


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    name: str
    result: tpu.CompileResult
    flops: float
    """Model FLOPs of one call on the whole mesh (decode round: one step at its largest
    bucket)."""
    hbm_bytes: int
    resident_bytes: int
    """Weights and decode state per chip: in HBM during every program, whether it reads them or
    not (jit drops the arguments a program does not read: prefill's LM head)."""

    @property
    def needed(self) -> int | None:
        """HBM per chip while the program runs: its own plan, plus the resident bytes it does not
        take as arguments."""
        memory = self.result.memory
        if memory is None:
            return None
        return memory.total + max(0, self.resident_bytes - memory.arguments)

    @property
    def fits(self) -> bool:
        """Compiled, and what it needs fits the chip."""
        return self.needed is not None and self.needed <= self.hbm_bytes


def settings(target: Target, mesh: Mesh | None) -> decoding.DecodeSettings:
    """The decode settings the engine would build for the target (see ``Engine.__init__``)."""
    config = target.generation.replace(kernels=target.kernels)
    return decode_settings(config, _mask_token(target.cfg), target.slots, "tpu", mesh)


def _mask_token(cfg: ModelConfig) -> int:
    # A static constant of the programs: its value changes no shape, no memory and no FLOPs.
    return cfg.mask_token_id if cfg.mask_token_id is not None else 0


def _shapes(target: Target) -> tuple[nnx.GraphDef, nnx.State, decoding.DecodeState]:
    """The graphdef, and the weights and the decode state as shapes (nothing allocated)."""
    graphdef, params = nnx.split(abstract_decoder(target.cfg))
    state = jax.eval_shape(lambda: decoding.init_state(
        target.cfg, target.slots, target.positions, target.block_size, _mask_token(target.cfg),
        target.pages))
    return graphdef, params, state


def resident(target: Target) -> sharding.Resident:
    """Bytes per chip of the weights and the decode state, as the engine places them (no libtpu
    needed: an abstract mesh of the target's shape)."""
    _, params, state = _shapes(target)
    mesh = AbstractMesh(target.mesh_shape, sharding.AXES)
    return sharding.resident_bytes(params, state, mesh)


def check(target: Target, decode: bool = True) -> Iterator[ProgramReport]:
    """Compile each program (prefill per bucket, then the decode round unless ``decode`` is
    false), yielding its report as soon as it is compiled."""
    mesh = tpu.make_mesh(target.topology, target.data, target.model, target.expert)
    graphdef, params, state = _shapes(target)
    params = tpu.abstract(params, sharding.param_shardings(params, mesh))
    state = tpu.abstract(state, sharding.state_sharding(state, mesh))
    step = settings(target, mesh)
    prefill = compilation.prefill_program("tpu", graphdef, step, target.slots, target.positions)

    def replicated(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    kept = resident(target).total
    block = target.block_size
    for n in prefill_rows(target.prefill_batch):
        rows = replicated((n,), jnp.int32)
        slot_params = jax.tree.map(lambda a: replicated(a.shape, a.dtype),
                                   slot_params_rows([], n))
        for length in target.prompt_buckets:
            result = tpu.compile_program(mesh, prefill, params, state,
                                         replicated((n, length), jnp.int32), rows, rows,
                                         slot_params)
            yield ProgramReport(f"prefill {n}x{length}", result,
                                prefill_flops(target.cfg, n, length, block), target.hbm_bytes,
                                kept)
    # A longer prompt's chunks: one row each, after the chunks before it in the cache.
    chunked = compilation.prefix_prefill_program("tpu", graphdef, step, target.slots,
                                                 target.positions, target.pages)
    one = replicated((1,), jnp.int32)
    one_params = jax.tree.map(lambda a: replicated(a.shape, a.dtype), slot_params_rows([], 1))
    for computed in target.chunk_buckets:
        result = tpu.compile_program(
            mesh, chunked, params, state, replicated((1, target.positions + computed), jnp.int32),
            one, one, one, one_params, computed=computed)
        yield ProgramReport(f"prefill chunk 1x{computed}", result,
                            prefill_flops(target.cfg, 1, computed, block), target.hbm_bytes,
                            kept)
    if not decode:
        return
    decode_round = compilation.decode_round_program(
        "tpu", graphdef, step, target.generation.steps_per_round, target.slots, target.positions)
    result = tpu.compile_program(mesh, decode_round, params, state, replicated((), jnp.bool_),
                                 replicated((), jnp.int32), replicated((), jnp.bool_),
                                 replicated((), jnp.int32))
    yield ProgramReport("decode round", result, decode_flops_range(target)[0], target.hbm_bytes,
                        kept)


# --------------------------------------------------------------------------- model FLOPs
def _qkv_flops(cfg: ModelConfig) -> int:
    """Matmul FLOPs of one token's q, k and v projections in one layer."""
    return 2 * cfg.hidden_size * cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads)


def _attention_flops(cfg: ModelConfig, keys: float) -> float:
    """FLOPs of one query row over ``keys`` keys in one layer (scores and weighted values)."""
    return 4 * cfg.num_heads * cfg.head_dim * keys


def decode_step_flops(cfg: ModelConfig, settings: decoding.DecodeSettings, slots: int,
                      processed: int, retained: int, keys: int) -> float:
    """Model FLOPs of one decode step of ``slots`` slots with ``processed`` and ``retained`` rows
    (their compactions' buckets), each row attending to ``keys`` cache positions.

    Layer 0 and layer 1's projections run the processed rows; the rest of layer 1, the layers
    after it and the LM head the retained rows (the head runs on their masked ones: an upper
    bound). FOCUS adds its importance: q . k over each slot's block in layers 0 and 1. With
    ``processed = retained = slots * B`` and ``keys`` the cache length this is the largest step:
    every slot live at the end of its cache.
    """
    qkv, rest = _qkv_flops(cfg), layer_flops_per_token(cfg) - _qkv_flops(cfg)
    attend = _attention_flops(cfg, keys)
    later = cfg.num_layers - 2
    flops = processed * (2 * qkv + rest + attend)
    flops += retained * (rest + attend + later * (qkv + rest + attend))
    flops += retained * 2 * cfg.hidden_size * cfg.vocab_size
    if settings.policies.eviction.evicts:
        b = settings.block_size
        flops += 2 * slots * 2 * cfg.num_heads * cfg.head_dim * b * b
    return float(flops)


def decode_flops_range(target: Target) -> tuple[float, float]:
    """Model FLOPs of a decode step in the largest and in the smallest bucket of both
    compactions (on every data shard), every row attending to the whole cache."""
    # The ladders are per data shard: settings on a mesh of the target's shape (abstract, so
    # no libtpu is needed).
    step = settings(target, AbstractMesh(target.mesh_shape, sharding.AXES))
    largest = target.slots * target.block_size
    smallest = step.retained_ladder[0] * target.data
    return tuple(decode_step_flops(target.cfg, step, target.slots, rows, rows, target.positions)
                 for rows in (largest, smallest))


def prefill_flops(cfg: ModelConfig, batch: int, length: int, block_size: int) -> float:
    """Model FLOPs of one prefill call: ``batch`` prompts of ``length`` tokens through every
    layer, each query over the keys block-causal attention lets it see (no LM head: prefill
    keeps only the KV)."""
    blocks = length // block_size
    visible = block_size * block_size * blocks * (blocks + 1) / 2  # keys, summed over queries
    per_layer = length * layer_flops_per_token(cfg) + _attention_flops(cfg, visible)
    return float(batch * cfg.num_layers * per_layer)


# ------------------------------------------------------------------------------------- report
def _gib(n: float) -> str:
    return f"{n / tpu.GIB:.2f}"


HEADER = (f"{'program':<18} {'result':<9} {'compile':>8}  {'arguments':>9} {'temporaries':>11} "
          f"{'outputs':>8} {'total':>7} {'of HBM':>6}  {'TFLOP':>8}")
"""Columns of :func:`format_report`: memory in GiB per chip (the total with the weights and
state a program does not read), model FLOPs on the whole mesh."""


def format_report(report: ProgramReport) -> str:
    """One line per program."""
    result = report.result
    head = f"{report.name:<18} "
    if not result.compiled:
        status = "too big" if result.out_of_memory else "FAILED"
        return head + f"{status:<9} {result.seconds:7.1f}s  {result.error}"
    memory = result.memory
    return (head + f"{'compiled' if report.fits else 'too big':<9} {result.seconds:7.1f}s  "
            f"{_gib(memory.arguments):>9} {_gib(memory.temporaries):>11} "
            f"{_gib(memory.outputs):>8} {_gib(report.needed):>7} "
            f"{100 * report.needed / report.hbm_bytes:5.0f}%  {report.flops / 1e12:8.2f}")


def _quantized(q: Quantization) -> str:
    activations = ("weights only" if q.activations_from is None else
                   f"{q.weights} activations from {q.activations_from} rows")
    return f"{q.weights} projections and experts ({activations})"


def describe(target: Target) -> str:
    """What is compiled for which slice, and what stays in memory between programs."""
    cfg, kept, chips = target.cfg, resident(target), target.chips
    largest, smallest = decode_flops_range(target)
    return "\n".join([
        f"{target.topology.name}: {target.topology.chips} x {target.topology.chip.device_kind}, "
        f"{_gib(target.hbm_bytes)} GiB HBM per chip; mesh data={target.data},expert={target.expert},"
        f"model={target.model}",
        f"model: {cfg.num_params / 1e9:.2f}B parameters in {cfg.dtype}"
        f"{'' if cfg.quantization is None else ', ' + _quantized(cfg.quantization)}; "
        f"batch {target.slots} x "
        f"{target.positions} positions, block {target.block_size}, mode "
        f"{target.generation.mode}, kernels {target.kernels}, "
        f"{len(target.generation.ladder_for('tpu'))}-bucket ladder",
        f"weights + decode state per chip: {_gib(kept.total)} GiB (weights {_gib(kept.weights)}, "
        f"decode state {_gib(kept.decode_state)})",
        f"decode step model FLOPs, every slot at {target.positions} positions: "
        f"{largest / 1e12:.2f} T at the largest bucket, {smallest / 1e12:.2f} T at the smallest "
        f"({largest / chips / 1e12:.2f} and {smallest / chips / 1e12:.2f} T per chip)",
    ])


def summary(reports: Sequence[ProgramReport]) -> str:
    """The verdict over all programs, in one line."""
    too_big = sum(not r.fits and (r.result.compiled or r.result.out_of_memory) for r in reports)
    failed = sum(not r.result.compiled and not r.result.out_of_memory for r in reports)
    if not failed and not too_big:
        return f"all {len(reports)} programs compiled and fit"
    return (f"of {len(reports)} programs, {failed} failed to compile and {too_big} do not fit "
            f"in HBM")
