"""The ``focus-jax`` command line: ``generate``, ``convert``, ``eval``, ``bench``, ``train``,
``demo``, ``serve``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from focus_jax import bundled, ctrl_c
from focus_jax.compilation import Compilations
from focus_jax.config import (
    DEFAULT_THRESHOLD,
    KV_LAYOUTS,
    MODES,
    QUANTIZED_TYPES,
    UNMASKING_RULES,
    ConfigError,
    GenerationConfig,
    ModelConfig,
    Quantization,
    mode_label,
)
from focus_jax.distributed import JOIN_TIMEOUT_SECONDS
from focus_jax.engine import RequestError, RunStats
from focus_jax.engine.core import CPU_SHAPE
from focus_jax.tasks import HELD_OUT_SEED, WORKED

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from focus_jax.checkpoint import TokenizerLoad
    from focus_jax.engine import Engine
    from focus_jax.model import Model

BUNDLED_MODEL = bundled.MODEL
GEOMETRY_NAMES = ("sdar-1.7b", "sdar-8b", "sdar-30b-a3b", "llada2-mini")
"""The named geometries of :data:`focus_jax.models.GEOMETRIES` (listed here: the parser is
built before the models are imported)."""
# Held-out questions (tests check that the training stream never yields them).
DEMO_PROMPTS = ("Add: 257+468", "Reverse: p a l l a s",
                "Ana has 12 apples, gets 9 more, gives away 6 and gets 3 more. "
                "How many apples does Ana have now?")


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help=f"model folder (Hugging Face or converted; default: {BUNDLED_MODEL})")
    parser.add_argument("--mode", choices=MODES, default="focus",
                        help="baseline: whole block each step; delayed: delayed KV cache; "
                             "focus: delayed cache + FOCUS eviction (default)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="confidence threshold (default: " + ", ".join(
                            f"{m} {t}" for m, t in DEFAULT_THRESHOLD.items()) + ")")
    parser.add_argument("--alpha", type=float, default=1.5, help="FOCUS budget factor")
    _add_commit_refresh_option(parser)
    parser.add_argument("--block-size", type=int, default=None,
                        help="block size (default: the model's)")
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="generated tokens per prompt, at most")
    parser.add_argument("--unmasking", choices=UNMASKING_RULES, default="low_confidence_dynamic",
                        help="which masked tokens a step decodes")
    parser.add_argument("--denoising-steps", type=int, default=None,
                        help="static/sequential rules: unmask ceil(block/steps) tokens per step "
                             "(default: one per step)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="slots decoded together (default: the number of prompts, rounded up "
                             "to a power of 2, at most 64)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="weights' dtype (default: the model's)")
    parser.add_argument("--no-chat", action="store_true",
                        help="do not apply the tokenizer's chat template")
    parser.add_argument("--bucket-ladder", default=None,
                        help="compaction bucket sizes as fractions of slots x block, "
                             "comma-separated (default: the platform's)")
    parser.add_argument("--stats", action="store_true",
                        help="print decoding and compilation statistics")
    _add_kv_cache_options(parser)
    _add_compile_cache_option(parser)
    _add_distribution_options(parser)


def _add_commit_refresh_option(parser: argparse.ArgumentParser) -> None:
    default = "on" if GenerationConfig.commit_refresh else "off"
    parser.add_argument("--commit-refresh", action=argparse.BooleanOptionalAction,
                        default=GenerationConfig.commit_refresh,
                        help="delayed and focus: at each block's commit, run its whole block "
                             "through every layer once more with its final tokens, replacing "
                             f"the delayed cache's stale KV (one extra pass per block; default: "
                             f"{default})")


def _add_quantize_options(parser: argparse.ArgumentParser, activations: bool = True) -> None:
    parser.add_argument("--quantize", choices=QUANTIZED_TYPES, default=None,
                        help="8-bit weights per output channel (docs/quantization.md; default: "
                             "none, a converted quantized folder stays quantized)")
    if activations:
        parser.add_argument("--quantize-activations-from", type=int, default=None,
                            metavar="ROWS",
                            help="also quantize activations, per token, in matmuls of at least "
                                 "ROWS rows (FP8 on Hopper GPUs, int8 on TPUs; default: weights "
                                 "only)")


def _quantization(args: argparse.Namespace) -> Quantization | None:
    rows = getattr(args, "quantize_activations_from", None)
    if rows is not None and args.quantize is None:
        raise ConfigError("--quantize-activations-from needs --quantize fp8 or int8")
    return None if args.quantize is None else Quantization(args.quantize, rows)


def _add_kv_cache_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache", choices=KV_LAYOUTS, default="contiguous",
                        help="KV cache layout: contiguous (every slot reserves the whole context) "
                             "or paged (a pool of one-block pages; requests hold their worst "
                             "case; default: contiguous)")
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="paged: GiB per device for the page pool (default: 85%% of the memory "
                             "left after the weights)")
    parser.add_argument("--kv-pages", type=int, default=None,
                        help="paged: pages in the pool (overrides --kv-cache-memory; default: from "
                             "the memory)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="paged: share the KV of whole prompt blocks requests have in common "
                             "(prefilled once)")


def _kv_cache(args: argparse.Namespace) -> dict:
    """The GenerationConfig fields of the KV cache options."""
    memory = None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**30)
    return {"kv_cache": args.kv_cache, "kv_cache_memory": memory, "kv_pages": args.kv_pages,
            "prefix_caching": args.prefix_caching}


def _add_compile_cache_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not keep compiled programs between runs (default: kept in "
                             "$FOCUS_JAX_CACHE_DIR, else ~/.cache/focus_jax/xla)")


def _compile_cache(args: argparse.Namespace) -> Path | None:
    """Turn the persistent compilation cache on (or off, with --no-compile-cache) before any
    compilation; returns its folder."""
    import jax

    from focus_jax import compilation

    if args.no_compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
    return compilation.use_persistent_cache()


def _ladder(text: str | None) -> dict[str, tuple[float, ...]]:
    """``--bucket-ladder`` as GenerationConfig arguments (none when not given)."""
    if text is None:
        return {}
    try:
        return {"bucket_ladder": tuple(float(f) for f in text.split(","))}
    except ValueError:
        raise ConfigError(f"--bucket-ladder {text!r} must be comma-separated fractions, e.g. "
                          f"0.25,0.5,1") from None


def _add_distribution_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default=None,
                        help="shard over devices: data=D,model=M (slots over data, heads/MLP "
                             "over model; default: one device)")
    parser.add_argument("--coordinator", default=None,
                        help="multi-process: host:port of process 0 (with --num-processes and "
                             "--process-id); on TPU pods use --distributed alone (default: one "
                             "process)")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="multi-process: how many processes (with --coordinator; default: "
                             "none)")
    parser.add_argument("--process-id", type=int, default=None,
                        help="multi-process: this process's index (with --coordinator; "
                             "default: none)")
    parser.add_argument("--distributed", action="store_true",
                        help="multi-process with arguments found by JAX (TPU pods, SLURM)")
    parser.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT_SECONDS,
                        help="seconds to wait for all processes to join; past it, exit with "
                             "code 2")


def _mesh(args: argparse.Namespace):
    """Join the processes (if asked) and build the mesh (if asked)."""
    from focus_jax import distributed
    from focus_jax.sharding import make_mesh, parse_mesh

    sizes = parse_mesh(args.mesh) if args.mesh is not None else None  # before any waiting
    joining = args.distributed or args.coordinator is not None
    if not joining and (args.num_processes is not None or args.process_id is not None):
        raise ConfigError("--num-processes and --process-id need --coordinator HOST:PORT")
    if joining:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               args.join_timeout)
    return make_mesh(**sizes) if sizes is not None else None


def _generation_config(args: argparse.Namespace) -> GenerationConfig:
    return GenerationConfig(
        mode=args.mode, block_size=args.block_size, threshold=args.threshold, alpha=args.alpha,
        commit_refresh=args.commit_refresh, unmasking=args.unmasking,
        denoising_steps=args.denoising_steps,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, max_batch=args.max_batch,
        **_ladder(args.bucket_ladder), **_kv_cache(args))


def load_model(path: Path | None, dtype: str | None = None, mesh=None,
               quantize: Quantization | None = None):
    """The model at ``path``; without one, the bundled model (``ConfigError`` if this install
    lacks it)."""
    from focus_jax.checkpoint import load

    return load(_model_path(path), dtype=dtype, mesh=mesh, quantize=quantize)


def _model_path(path: Path | None) -> Path:
    """``path``, or the bundled model's folder (``ConfigError`` if this install lacks it)."""
    if path is None and not (BUNDLED_MODEL / "config.json").is_file():
        raise ConfigError(f"the bundled model is missing from this install ({BUNDLED_MODEL}): "
                          f"reinstall focus-jax, or pass --model PATH")
    return BUNDLED_MODEL if path is None else path


def format_stats(stats: RunStats, num_layers: int) -> str:
    """A few lines describing a run."""
    steps = max(stats.steps, 1)
    lines = [
        f"steps {stats.steps} (rounds {stats.rounds}), generated {stats.generated_tokens} tokens "
        f"in {stats.wall_seconds:.2f}s ({stats.tokens_per_second:.1f} tok/s): decode rounds "
        f"{stats.decode_seconds:.2f}s, prefill {stats.prefill_seconds:.2f}s, "
        f"host {stats.host_seconds:.2f}s",
        f"per step: processed {stats.processed_tokens / steps:.2f} tokens (layers 0-1), "
        f"retained {stats.retained_tokens / steps:.2f} (layers >= 2), "
        f"decoded {stats.decoded_tokens / steps:.2f}",
        f"token-layers per generated token: "
        f"{stats.token_layers(num_layers) / max(stats.generated_tokens, 1):.1f}",
        f"processed bucket histogram {dict(sorted(stats.processed_buckets.items()))}; "
        f"retained {dict(sorted(stats.retained_buckets.items()))}",
        f"prompt tokens {stats.prompt_tokens}, {stats.cached_prompt_tokens} from the prefix cache "
        f"(hit rate {100 * stats.prefix_hit_rate:.1f}%), {stats.prefilled_tokens} prefilled"
        + (f"; KV pages: at most {stats.kv_pages_peak} used of {stats.kv_pages} "
           f"({stats.kv_pages - stats.kv_pages_peak} free then)" if stats.kv_pages else ""),
    ]
    return "\n".join(lines)


def format_compilations(compiled: Compilations, cache: Path | None) -> str:
    """One line: programs compiled and read back from the persistent cache, and its folder."""
    where = f"persistent cache {cache}" if cache else "persistent cache off"
    return (f"compilation: {compiled.compiled} programs compiled, {compiled.loaded} read from "
            f"the {where}, {compiled.seconds:.2f}s")


def cmd_generate(args: argparse.Namespace) -> int:
    from focus_jax.api import generate
    from focus_jax.compilation import count_compilations
    from focus_jax.distributed import is_primary
    from focus_jax.prompts import read_prompts_file

    # Everything that needs no model and no other process is checked first.
    config = _generation_config(args)
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += read_prompts_file(Path(args.prompts_file))
    if not prompts:
        raise ConfigError("give --prompt TEXT (repeatable) or --prompts-file FILE")
    cache = _compile_cache(args)
    mesh = _mesh(args)
    model = load_model(args.model, args.dtype, mesh, _quantization(args))
    stream = len(prompts) == 1 and not args.no_stream and is_primary()
    printer = _StreamPrinter(model.tokenizer) if stream else None
    with count_compilations() as compiled:
        results, stats = generate(model, prompts, config, chat=not args.no_chat,
                                  progress=not stream and is_primary(), on_tokens=printer,
                                  return_stats=True, mesh=mesh)
    if not is_primary():
        return 0
    if stream:
        printer.finish(results[0].token_ids)
    else:
        for prompt, result in zip(prompts, results, strict=True):
            print(f"### {prompt}\n{result.text}\n")
    if args.stats:
        print(format_stats(stats, model.config.num_layers), file=sys.stderr)
        print(format_compilations(compiled, cache), file=sys.stderr)
    return 0


class _StreamPrinter:
    """Prints text as blocks complete (decoding the whole output each time keeps bytes whole)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def __call__(self, _index: int, new_ids: list[int]) -> None:
        self.ids += new_ids
        self._show(self.ids)

    def _show(self, ids: list[int]) -> None:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if text.startswith(self.shown):
            print(text[len(self.shown):], end="", flush=True)
        else:
            print("\n" + text, end="", flush=True)
        self.shown = text

    def finish(self, ids: list[int]) -> None:
        self._show(ids)
        print()


def cmd_convert(args: argparse.Namespace) -> int:
    from focus_jax.checkpoint import convert

    out = convert(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                  quantize=args.quantize)
    print(f"wrote {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from focus_jax.api import generate
    from focus_jax.compilation import count_compilations

    config = GenerationConfig(mode="focus", max_new_tokens=args.max_new_tokens)
    cache = _compile_cache(args)
    model = load_model(args.model)
    if not model.config.block_size:
        config = config.replace(block_size=8)
    with count_compilations() as compiled:
        for prompt in DEMO_PROMPTS:
            print(f">>> {prompt}")
            printer = _StreamPrinter(model.tokenizer)
            results, stats = generate(model, prompt, config, on_tokens=printer,
                                      return_stats=True)
            printer.finish(results[0].token_ids)
            print(format_stats(stats, model.config.num_layers) + "\n")
    print(format_compilations(compiled, cache))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from focus_jax import evaluate, tasks

    _require_positive(args, "per_task", "max_batch", "max_new_tokens", "alpha")
    names = tuple(args.tasks.split(","))
    unknown = [t for t in names if t not in tasks.TASKS]
    if unknown:
        raise ConfigError(f"unknown task(s) {unknown}; choose from {sorted(tasks.TASKS)}")
    modes = _modes(args.modes)
    _compile_cache(args)
    model = load_model(args.model, args.dtype, quantize=_quantization(args))
    reports = evaluate.evaluate(model, tasks.held_out(args.per_task, args.seed, tasks=names),
                                modes, max_batch=args.max_batch,
                                max_new_tokens=args.max_new_tokens, alpha=args.alpha,
                                commit_refresh=args.commit_refresh, progress=True)
    table = evaluate.markdown(reports)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": str(args.model or BUNDLED_MODEL), "per_task": args.per_task,
             "seed": args.seed, "max_new_tokens": args.max_new_tokens,
             "modes": [r.summary() for r in reports]}, indent=1) + "\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    _most_of_the_gpu()
    import jax

    from focus_jax import bench
    from focus_jax.distributed import is_primary

    # Every option is checked before the peak measurement and the model (minutes on a CPU).
    batches = _positive_integers("--batches", args.batches)
    modes = _modes(args.modes)
    _require_positive(args, "requests_per_slot", "requests", "max_new_tokens")
    ladder = {**_ladder(args.bucket_ladder), "steps_per_round": args.steps_per_round,
              "kernels": args.kernels, "commit_refresh": args.commit_refresh,
              **_kv_cache(args)}
    GenerationConfig(max_new_tokens=args.max_new_tokens, **ladder)
    _check_kernels(args.kernels)
    rates = _positive_rates(args.request_rate) if args.request_rate else None
    _long_prompts(args)
    if args.compile_only and (rates or args.no_compile_cache):
        raise ConfigError("--compile-only fills the compilation cache for closed-loop runs: "
                          "it takes neither --request-rate nor --no-compile-cache")
    _compile_cache(args)
    mesh = _mesh(args)  # the engine shards the parameters and its state over it
    quantization = _quantization(args)
    # Compiling only, a geometry's weights need no memory: several such processes can fill the
    # compilation cache side by side, each at any size.
    model = (bench.random_model(args.geometry, quantization=quantization,
                                abstract=args.compile_only and mesh is None) if args.geometry
             else load_model(args.model, quantize=quantization))
    peaks = {} if args.compile_only else {"bf16": bench.measured_bf16_peak()}
    if peaks and quantization is not None and quantization.activations_from is not None:
        # Products with 8-bit activations run on 8-bit tensor cores: MFU against their peak too.
        peaks[quantization.weights] = bench.measured_8bit_peak(quantization.weights)
    say = print if is_primary() else (lambda *a, **k: None)
    say(f"{jax.devices()[0].device_kind} x{jax.device_count()}, mesh {args.mesh or 'none'}; "
        + ("compiling only" if args.compile_only else ", ".join(
            f"measured {dtype} peak {flops / 1e12:.3g} TFLOP/s" for dtype, flops in peaks.items())))
    runs = (_open_loop_rows(args, model, mesh, ladder, batches, modes, rates) if rates else
            _closed_loop_rows(args, model, mesh, ladder, batches, modes, peaks))
    rows = []
    for row, line in runs:
        rows.append(row)
        say(line, flush=True)
        if args.json and is_primary():  # rewritten after each run: a crash keeps the rows so far
            Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _closed_loop_rows(args: argparse.Namespace, model, mesh, generation: dict,
                      batches: list[int], modes: list[str],
                      peaks: dict[str, float]) -> Iterator[tuple[dict, str]]:
    """``bench``: all requests at once, per batch and mode; a JSON row and a line per run.
    ``peaks``: measured FLOP/s per dtype (bf16, and the 8-bit type where activations are
    quantized); MFU is reported against the bf16 peak, and against the 8-bit one too."""
    import jax

    from focus_jax import bench
    from focus_jax.distributed import is_primary

    if mesh is None and len(batches) * len(modes) > 1:
        # Every run's programs at once, side by side: each run then compiles nothing.
        seconds = bench.compile_runs(model, modes, batches, args.requests_per_slot,
                                     args.max_new_tokens, long_prompts=_long_prompts(args),
                                     max_model_len=args.max_model_len,
                                     requests=args.requests, **generation)
        if is_primary():
            print(f"compiled the programs of {len(batches) * len(modes)} runs in {seconds:.1f}s",
                  flush=True)
    for batch in batches:
        for r in bench.run(model, modes, batch, _requests(args, batch),
                           args.max_new_tokens, mesh=mesh, long_prompts=_long_prompts(args),
                           max_model_len=args.max_model_len, compile_only=args.compile_only,
                           **generation):
            if args.compile_only:
                yield dataclasses.asdict(r), (
                    f"{args.model or args.geometry or BUNDLED_MODEL.name} bs{batch} "
                    f"{mode_label(r.mode, args.commit_refresh):8s} compiled in "
                    f"{r.compile_seconds:5.1f}s ({r.warmup_compiled} compiled, "
                    f"{r.warmup_loaded} from cache)")
                continue
            devices = jax.device_count()
            # bf16's fields unprefixed (as ever), an 8-bit peak's prefixed with its type.
            utilisation = {
                f"{'' if dtype == 'bf16' else dtype + '_'}{key}": value
                for dtype, flops in peaks.items()
                for key, value in (("mfu", r.mfu(flops * devices)),
                                   ("decode_mfu", r.decode_mfu(flops * devices)),
                                   ("peak_flops", flops))}
            eight_bit = [dtype for dtype in peaks if dtype != "bf16"]
            row = {**dataclasses.asdict(r), "tokens_per_second": r.tokens_per_second,
                   "step_ms": r.step_ms, **utilisation,
                   "model": str(args.model or args.geometry or BUNDLED_MODEL.name),
                   "mesh": args.mesh, "kernels": args.kernels,
                   "commit_refresh": args.commit_refresh,
                   "quantize": args.quantize,
                   "quantize_activations_from": args.quantize_activations_from,
                   "num_layers": model.config.num_layers,
                   "devices": jax.device_count()}
            yield row, (
                f"{row['model']}{'' if args.quantize is None else ' ' + args.quantize} bs{batch} "
                f"{mode_label(r.mode, args.commit_refresh):8s} {r.tokens_per_second:8.1f} tok/s  "
                f"step {r.step_ms:6.2f} ms  processed {r.processed_per_step:7.1f}  "
                f"retained {r.retained_per_step:7.1f}  decoded {r.decoded_per_step:6.2f}  "
                f"MFU {100 * row['mfu']:5.1f}% (decode {100 * row['decode_mfu']:5.1f}%)  "
                + "".join(f"of the {dtype} peak {100 * row[dtype + '_mfu']:5.1f}% (decode "
                          f"{100 * row[dtype + '_decode_mfu']:5.1f}%)  " for dtype in eight_bit)
                + f"compile {r.compile_seconds:5.1f}s ({r.warmup_compiled} compiled, "
                f"{r.warmup_loaded} from cache)  "
                f"prefill {100 * r.prefill_seconds / r.wall_seconds:4.1f}%  "
                f"host {100 * r.host_seconds / r.wall_seconds:4.1f}%  "
                f"compiles after warm-up {r.compilations}"
                + (f"  KV pages {r.kv_pages_peak}/{r.kv_pages}  prefix hits "
                   f"{100 * r.prefix_hit_rate:.1f}%" if r.kv_pages else ""))


def _long_prompts(args: argparse.Namespace) -> tuple[float, int, int] | None:
    """``--long-prompts FRACTION:MIN:MAX``."""
    if args.long_prompts is None:
        return None
    try:
        fraction, low, high = args.long_prompts.split(":")
        parsed = float(fraction), int(low), int(high)
    except ValueError:
        parsed = None
    if parsed is None or not (0 <= parsed[0] <= 1 and 1 <= parsed[1] <= parsed[2]):
        raise ConfigError(f"--long-prompts must be FRACTION:MIN:MAX (e.g. 0.05:4096:8192), got "
                          f"{args.long_prompts!r}")
    return parsed


def _requests(args: argparse.Namespace, batch: int) -> int:
    """``bench``: a run's requests, ``--requests`` or ``--requests-per-slot`` x its batch."""
    return args.requests or batch * args.requests_per_slot


def _open_loop_rows(args: argparse.Namespace, model, mesh, generation: dict,
                    batches: list[int], modes: list[str],
                    rates: list[float]) -> Iterator[tuple[dict, str]]:
    """``bench --request-rate R1,R2,...``: Poisson arrivals at each rate, per batch and mode."""
    from focus_jax import bench

    for batch in batches:
        for rate in rates:
            for mode in modes:
                r = bench.run_open_loop(model, mode, batch, _requests(args, batch),
                                        args.max_new_tokens, rate, mesh=mesh, **generation)
                row = {**dataclasses.asdict(r), "tokens_per_second": r.tokens_per_second,
                       "step_ms": r.step_ms, "model": str(args.model or args.geometry),
                       "commit_refresh": args.commit_refresh}
                yield row, (
                    f"bs{batch} rate {rate:g}/s {mode_label(mode, args.commit_refresh):8s} "
                    f"{r.tokens_per_second:8.1f} tok/s  "
                    f"step {r.step_ms:6.2f} ms  admission wait mean {r.admission_wait['mean']:.3f}s"
                    f"  first block p50/p90/p99 {r.first_block['p50']:.2f}/"
                    f"{r.first_block['p90']:.2f}/{r.first_block['p99']:.2f}s  per token p50 "
                    f"{1000 * r.per_token['p50']:.1f} ms  latency p50/p90/p99 "
                    f"{r.latency['p50']:.1f}/{r.latency['p90']:.1f}/{r.latency['p99']:.1f}s  "
                    f"compiles {r.compilations}")


def _positive_integers(option: str, text: str) -> list[int]:
    """A comma-separated option of integers >= 1."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"{option} {text!r} must be comma-separated integers >= 1, e.g. 32,64")
    return values


def _positive_rates(text: str) -> list[float]:
    """``--request-rate``: comma-separated request rates > 0 (requests per second)."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise ConfigError(f"--request-rate {text!r} must be comma-separated rates > 0, e.g. 4,11,20")
    return values


def _modes(text: str) -> list[str]:
    """``--modes``: comma-separated decoding modes."""
    modes = text.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ConfigError(f"--modes: unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    return modes


def _require_positive(args: argparse.Namespace, *names: str) -> None:
    """Options (by ``args`` attribute) that must be > 0 when given; NaN is refused too."""
    for name in names:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")


TRAIN_DEFAULTS = {"steps": (10, 1000), "batch_size": (4, 16), "seq_len": (160, 512)}
"""``focus-jax train``'s defaults on a CPU and elsewhere: on a 2-core CPU the bundled model's run
takes about a minute (docs/startup.md)."""


def _train_defaults(name: str) -> tuple[int, int]:
    return TRAIN_DEFAULTS[name]


def cmd_train(args: argparse.Namespace) -> int:
    import jax

    from focus_jax.config import SUPPORTED_BLOCK_SIZES
    from focus_jax.train import PairSource, TrainConfig, run, train

    # Everything that needs no model is checked before the model loads.
    _require_positive(args, "steps", "batch_size", "seq_len", "learning_rate", "log_every",
                      "checkpoint_every", "checkpoint_seconds")
    on_cpu = jax.default_backend() == "cpu"
    for name, (cpu, elsewhere) in TRAIN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu if on_cpu else elsewhere)
    if args.block_size is not None and args.block_size not in SUPPORTED_BLOCK_SIZES:
        raise ConfigError(f"--block-size {args.block_size} is not supported; supported: "
                          f"{SUPPORTED_BLOCK_SIZES}")
    run.check_folder(args.out)
    model = load_model(args.model, "float32")
    block = args.block_size or model.config.block_size
    if block is None:
        raise ConfigError("the model names no block_size: pass --block-size")
    if args.seq_len % block:
        raise ConfigError(f"--seq-len {args.seq_len} is not a multiple of the block size {block}")
    source = PairSource(model, args.data, args.batch_size, args.seq_len, seed=args.seed)
    if source.dropped:
        print(f"note: {source.dropped} pairs longer than {args.seq_len} tokens were dropped",
              file=sys.stderr)
    cfg = TrainConfig(steps=args.steps, learning_rate=args.learning_rate, block_size=block,
                      warmup_steps=min(100, args.steps // 10), seed=args.seed,
                      log_every=args.log_every, checkpoint_every=args.checkpoint_every,
                      checkpoint_seconds=args.checkpoint_seconds)
    try:
        train(model, source, cfg, args.out, overwrite=args.overwrite)
    except KeyboardInterrupt as stop:
        print(f"focus-jax: {stop or 'interrupted'}", file=sys.stderr)
        return 130
    print(f"wrote {Path(args.out) / run.MODEL_DIR}")
    return 0


SERVE_SLOTS = 32
"""The server's default slots on GPUs and TPUs (on a CPU: ``SERVE_CPU_SHAPE``)."""
SERVE_CPU_SHAPE = CPU_SHAPE
"""The server's default slots and context on a CPU: a chat answers in seconds (docs/startup.md)."""
SERVE_CPU_LADDER = (0.25, 1.0)
"""The server's bucket ladder at its default CPU shape: one slot's block, or all four. Its decode
round compiles in about 8 s less than ``CPU_LADDER``'s on the 2-core machine (a third of a cold
start), for about 0.1 s more on a chat while other slots decode too (docs/startup.md)."""
SERVE_EXTRA = ("fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client", "httpx")
"""Modules of the ``serve`` extra (and theirs) that the server imports."""
SERVE_CONTEXT = 4096
"""The server's default context (cache positions per slot) when the model allows more."""


def _free_slot_round_steps(args: argparse.Namespace) -> int:
    """Rounds while a slot is free: short ones only admit arrivals sooner, which round
    interrupts do at the next step anyway; longer ones spend less time between rounds
    (docs/serving.md, "Round interrupts")."""
    if args.free_slot_round_steps is not None:
        return args.free_slot_round_steps
    return (GenerationConfig.steps_per_round if args.round_interrupts
            else GenerationConfig.free_slot_round_steps)


def _serve_setting(args: argparse.Namespace, cfg: ModelConfig, on_cpu: bool
                   ) -> tuple[int, int, GenerationConfig]:
    """The server's slots, context and generation config from its options and the model's
    config (defaults by platform)."""
    slots = args.max_batch or (SERVE_CPU_SHAPE[0] if on_cpu else SERVE_SLOTS)
    positions = cfg.max_position_embeddings
    context = args.max_model_len or min(positions, SERVE_CPU_SHAPE[1] if on_cpu else SERVE_CONTEXT)
    if not 1 <= context <= positions:
        raise ConfigError(f"--max-model-len must lie in [1, {positions}] (the model's "
                          f"max_position_embeddings), got {context}")
    ladder = _ladder(args.bucket_ladder)
    if on_cpu and args.max_batch is None and not ladder:
        ladder = {"bucket_ladder": SERVE_CPU_LADDER}
    config = GenerationConfig(mode=args.mode, kernels=args.kernels, **ladder,
                              commit_refresh=args.commit_refresh,
                              interruptible_rounds=args.round_interrupts,
                              free_slot_round_steps=_free_slot_round_steps(args), **_kv_cache(args))
    return slots, context, config


def _load_and_compile(described: Model, path: Path, config: GenerationConfig, slots: int,
                      context: int, mesh: Mesh | None, quantization: Quantization | None,
                      tokenizer: TokenizerLoad) -> Engine:
    """The warmed-up engine of the folder ``path`` (``described``: its :func:`describe`, with
    ``tokenizer`` still loading), its load and start-up reported on stderr. The programs need
    the weights' shapes only: they compile while the weights load (not for weights quantized
    as they load, nor onto a mesh). A paged pool sized by the memory left after the weights is
    sized once, from the description, for both engines."""
    import jax

    from focus_jax import compilation
    from focus_jax.checkpoint import load_weights
    from focus_jax.engine import Engine, compile_ahead

    began, ahead = time.perf_counter(), None
    try:
        with compilation.count_compilations() as seen:
            if quantization is None and described.config.quantization is None and mesh is None:
                compiler = Engine(described, config, slots=slots, cache_len=context)
                if compiler.scheduler.pool is not None:
                    config = config.replace(kv_pages=compiler.scheduler.pool.total)
                ahead = compile_ahead(compiler)
            model = load_weights(described, path, mesh=mesh, quantize=quantization,
                                 tokenizer=tokenizer)
            jax.block_until_ready(model.params)
            print(f"focus-jax serve: model loaded in {time.perf_counter() - began:.1f} s",
                  file=sys.stderr, flush=True)
            engine = Engine(model, config, slots=slots, cache_len=context, mesh=mesh)
            if ahead is not None:
                ahead.join()  # its failure, if any, is the warm-up's below
            engine.warmup()
    except KeyboardInterrupt:
        if ahead is not None and ahead.is_alive():  # not through the interpreter's shutdown
            print(ctrl_c.MESSAGE, file=sys.stderr, flush=True)  # while XLA compiles beside it
            ctrl_c.exit_now()
        raise
    except USER_ERRORS as err:  # a bad folder (weights, tokenizer): said now, not after the
        if ahead is not None and ahead.is_alive():  # compile beside it, which exit would await
            print(error_line(err), file=sys.stderr, flush=True)
            ctrl_c.exit_now(2)
        raise
    print(f"focus-jax serve: ready {time.perf_counter() - began:.1f} s after the load began "
          f"({seen.compiled} programs compiled, {seen.loaded} read from the compilation cache)",
          file=sys.stderr, flush=True)
    return engine


def _most_of_the_gpu() -> None:
    """Before the backend starts, for processes that have the GPU to themselves (``bench``,
    ``serve``): XLA's pool gets 95% of its memory, not 75%, unless
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise (batch 256 of the 8B geometry needs 55 GiB
    of weights and cache and room for the round's temporaries; on an 80 GB H100 a server of
    128 slots x 2,048 positions ran out of memory warming up with 75%)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")


def cmd_serve(args: argparse.Namespace) -> int:
    _most_of_the_gpu()
    import jax

    from focus_jax.checkpoint import TokenizerLoad, describe
    from focus_jax.engine import AsyncEngine
    from focus_jax.sharding import make_mesh, parse_mesh

    try:
        from focus_jax.serve import ServeSettings, create_app, listen_socket, serve
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in SERVE_EXTRA:
            raise
        raise ConfigError(f"focus-jax serve needs {err.name}, which is not installed: "
                          f"pip install 'focus-jax[serve]'") from None

    if (args.max_batch is not None and args.max_batch < 1) or args.max_queue < 1:
        raise ConfigError(f"--max-batch and --max-queue must be >= 1, got {args.max_batch} and "
                          f"{args.max_queue}")
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as err:
        raise ConfigError(f"cannot listen on {args.host}:{args.port} ({err.strerror}): choose "
                          f"another --port or --host") from None
    _check_kernels(args.kernels)
    mesh = make_mesh(**parse_mesh(args.mesh)) if args.mesh else None
    _compile_cache(args)  # before loading: on an accelerator the loader compiles its conversions
    path = _model_path(args.model)
    # The tokenizer loads beside the compile and the weights (transformers imports torch where
    # it is installed: seconds on a GPU machine); the server needs it.
    tokenizer = TokenizerLoad(path)
    described = describe(path, dtype=args.dtype, mesh=mesh, tokenizer=tokenizer)
    on_cpu = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform == "cpu"
    slots, context, config = _serve_setting(args, described.config, on_cpu)
    name = args.served_model_name or path.resolve().name
    print(f"focus-jax serve: loading {name!r} and compiling every program for {slots} slots x "
          f"{context} positions, {args.mode} mode ...", file=sys.stderr, flush=True)
    engine = _load_and_compile(described, path, config, slots, context, mesh, _quantization(args),
                               tokenizer)
    app = create_app(AsyncEngine(engine, max_queue=args.max_queue),
                     ServeSettings(model_name=name, api_key=args.api_key,
                                   grace_seconds=args.grace_period))
    host, port = sock.getsockname()[:2]
    print(f"focus-jax serve: {name!r} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    serve(app, sock, log_level=args.log_level)
    return 0


def cmd_compile_check(args: argparse.Namespace) -> int:
    from focus_jax.compilation import persistent_cache_off

    # No program compiled for a TPU topology can be loaded back from the persistent cache, so
    # the check neither reads nor writes it (restored after: callers in-process keep theirs).
    with persistent_cache_off():
        return _compile_check(args)


def _compile_check(args: argparse.Namespace) -> int:
    from focus_jax import compile_check, tpu
    from focus_jax.config import ModelConfig
    from focus_jax.models import geometry
    from focus_jax.quant import check_platform

    if (args.geometry is None) == (args.model is None):
        raise ConfigError("give one of --geometry NAME or --model PATH")
    if args.geometry:
        cfg = geometry(args.geometry, args.dtype or "bfloat16")
    else:
        cfg = ModelConfig.from_file(args.model / "config.json", dtype=args.dtype)
    quantization = _quantization(args)
    if quantization is not None:
        check_platform(quantization, "tpu")
        cfg = cfg.replace(quantization=quantization)
    ladder = ({"bucket_ladder": tuple(float(f) for f in args.bucket_ladder.split(","))}
              if args.bucket_ladder else {})
    # Sampling settings are per-slot arrays of the decode state: no option of theirs changes a
    # compiled program, so compile-check has none.
    config = GenerationConfig(mode=args.mode, block_size=args.block_size, kernels=args.kernels,
                              **ladder, **_kv_cache(args))
    prompts = {"all": None, "none": ()}.get(args.prompt_buckets)
    if args.prompt_buckets not in ("all", "none"):
        prompts = tuple(int(n) for n in args.prompt_buckets.split(","))
    target = compile_check.make_target(
        cfg, args.topology, slots=args.batch, positions=args.max_len, generation=config,
        mesh=args.mesh, prompt_lengths=prompts, prefill_batch=args.prefill_batch,
        hbm_gib=args.hbm_gib)
    tpu.require_libtpu()
    print(compile_check.describe(target), flush=True)
    print(compile_check.HEADER, flush=True)
    reports = []
    for report in compile_check.check(target):
        reports.append(report)
        print(compile_check.format_report(report), flush=True)
    print(compile_check.summary(reports))
    return 0 if all(r.fits for r in reports) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="focus-jax", description=(
        "Block-diffusion language models in JAX with FOCUS eviction."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate_command(sub)
    _add_convert_command(sub)
    _add_eval_command(sub)
    _add_bench_command(sub)
    _add_train_command(sub)
    _add_demo_command(sub)
    _add_serve_command(sub)
    _add_compile_check_command(sub)
    return parser


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``: appended where the help does not say it already
    (options whose default depends on the model or the platform say it in words)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A sub-command's parser: its help shows the defaults."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=_Help, **kwargs)


def _add_generate_command(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text for prompts")
    _add_generation_options(gen)
    gen.add_argument("--prompt", action="append",
                     help="a prompt (repeatable; --prompt or --prompts-file is required)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line (with or instead of "
                                            "--prompt; default: none)")
    gen.add_argument("--no-stream", action="store_true", help="print at the end, not as it comes")
    _add_quantize_options(gen)
    gen.set_defaults(func=cmd_generate)


def _add_convert_command(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="convert a Hugging Face folder to an orbax folder")
    conv.add_argument("hf_dir", type=Path, help="a Hugging Face model folder")
    conv.add_argument("out_dir", type=Path, help="the orbax model folder to write")
    conv.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                      help="weights' dtype (default: the model's)")
    conv.add_argument("--overwrite", action="store_true",
                      help="replace the model folder at OUT_DIR (kept until the new one is complete)")
    _add_quantize_options(conv, activations=False)
    conv.set_defaults(func=cmd_convert)


def _add_eval_command(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="exact match and compute of the modes on held-out tasks")
    ev.add_argument("--model", type=Path, default=None,
                    help=f"model folder (default: {BUNDLED_MODEL})")
    ev.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="weights' dtype (default: the model's)")
    ev.add_argument("--per-task", type=int, default=50, help="held-out questions per task")
    ev.add_argument("--tasks", default=",".join(WORKED),
                    help="comma-separated task names (focus_jax.tasks.TASKS; default: the worked "
                         "suite the bundled model was trained on)")
    ev.add_argument("--modes", default="baseline,delayed,focus", help="comma-separated modes")
    ev.add_argument("--seed", type=int, default=HELD_OUT_SEED,
                    help="draws the held-out questions (another seed: other questions, all "
                         "held out from training)")
    ev.add_argument("--alpha", type=float, default=1.5, help="FOCUS budget factor")
    _add_commit_refresh_option(ev)
    ev.add_argument("--max-batch", type=int, default=64, help="slots decoded together")
    ev.add_argument("--max-new-tokens", type=int, default=128,
                    help="the worked answers run to about 100 tokens")
    ev.add_argument("--markdown",
                    help="also write the tables to this file (default: print only)")
    ev.add_argument("--json",
                    help="also write every mode's numbers, per task and overall, to this file "
                         "(default: print only)")
    _add_compile_cache_option(ev)
    _add_quantize_options(ev)
    ev.set_defaults(func=cmd_eval)


def _add_kernels_option(parser: argparse.ArgumentParser) -> None:
    from pallas_kernels.dispatch import RUNS_ON

    # The interpreter variants are for tests, not for runs.
    kernels = [name for name in RUNS_ON if not name.endswith("_interpret")]
    parser.add_argument("--kernels", choices=kernels, default=None,
                        help="attention and importance kernels (default: the platform's; "
                             "pallas_triton: the experimental Pallas Triton attention)")


def _check_kernels(kernels: str | None) -> None:
    """``--kernels`` for this machine's devices, checked before any loading or measuring."""
    import jax

    from pallas_kernels.dispatch import unusable

    if kernels is not None and (why := unusable(kernels, jax.default_backend())):
        raise ConfigError(f"--kernels: {why}")


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    be = sub.add_parser("bench", help="closed-loop throughput of the modes")
    be.add_argument("--geometry", choices=GEOMETRY_NAMES, default=None,
                    help="random weights of this geometry (default: --model's weights)")
    be.add_argument("--model", type=Path, default=None,
                    help=f"model folder (default: {BUNDLED_MODEL}, unless --geometry)")
    be.add_argument("--batches", default="32", help="comma-separated batch sizes (slots)")
    requests = be.add_mutually_exclusive_group()
    requests.add_argument("--requests-per-slot", type=int, default=1,
                          help="requests per slot and run (default: 1)")
    requests.add_argument("--requests", type=int, default=None,
                          help="requests per run, whatever its batch: the same request set at "
                               "every batch (default: --requests-per-slot x the batch)")
    be.add_argument("--max-new-tokens", type=int, default=1024, help="generated tokens per request")
    be.add_argument("--modes", default="baseline,delayed,focus", help="comma-separated modes")
    _add_commit_refresh_option(be)
    be.add_argument("--bucket-ladder", default=None,
                    help="compaction bucket sizes as fractions of slots x block, comma-separated "
                         "(default: the platform's)")
    be.add_argument("--request-rate", default=None,
                    help="open loop: Poisson arrivals at these rates (requests/s, comma-separated)"
                         " (default: closed loop, all requests at once)")
    be.add_argument("--steps-per-round", type=int, default=GenerationConfig.steps_per_round,
                    help="denoising steps per device round (admissions happen between rounds)")
    be.add_argument("--long-prompts", default=None,
                    help="closed loop: FRACTION:MIN:MAX, that fraction of the requests with "
                         "prompts of MIN to MAX tokens (e.g. 0.05:4096:8192; default: none)")
    be.add_argument("--max-model-len", type=int, default=None,
                    help="closed loop: positions per slot (default: the longest prompt plus "
                         "--max-new-tokens)")
    be.add_argument("--json", default=None,
                    help="write the rows (and MFU) to this file (default: print only)")
    be.add_argument("--compile-only", action="store_true",
                    help="closed loop: compile every run's programs into the compilation cache "
                         "and serve nothing; with --geometry and no --mesh it holds no weights "
                         "in device memory (fill the cache from parallel processes, then time "
                         "the runs one after another; default: off)")
    _add_quantize_options(be)
    _add_kernels_option(be)
    _add_kv_cache_options(be)
    _add_compile_cache_option(be)
    _add_distribution_options(be)
    be.set_defaults(func=cmd_bench)


def _add_train_command(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("train", help="fine-tune a model on (prompt, response) pairs")
    tr.add_argument("--model", type=Path, default=None,
                    help=f"model folder to start from (default: {BUNDLED_MODEL})")
    tr.add_argument("--data", type=Path, required=True,
                    help='JSON lines: {"prompt": ..., "response": ...}')
    tr.add_argument("--out", type=Path, required=True,
                    help="the run's folder (checkpoints, log.jsonl, the model in OUT/model); the "
                         "same command again resumes the run")
    tr.add_argument("--overwrite", action="store_true",
                    help="start over in an --out that holds another run")
    tr.add_argument("--steps", type=int, default=None,
                    help="optimizer steps (default: {} on a CPU, {} elsewhere)".format(
                        *_train_defaults("steps")))
    tr.add_argument("--batch-size", type=int, default=None,
                    help="sequences per step (default: {} on a CPU, {} elsewhere)".format(
                        *_train_defaults("batch_size")))
    tr.add_argument("--seq-len", type=int, default=None,
                    help="tokens per sequence; longer pairs are dropped (default: {} on a CPU, "
                         "{} elsewhere)".format(*_train_defaults("seq_len")))
    tr.add_argument("--learning-rate", type=float, default=1e-5, help="AdamW's peak learning rate")
    tr.add_argument("--block-size", type=int, default=None,
                    help="block size to train with (default: the model's); the exported config "
                         "says it")
    tr.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    tr.add_argument("--log-every", type=int, default=50, help="steps between log.jsonl records")
    tr.add_argument("--checkpoint-every", type=int, default=None,
                    help="also save a checkpoint every N steps (default: by time only)")
    tr.add_argument("--checkpoint-seconds", type=float, default=180.0,
                    help="save a checkpoint at least this often, in seconds (also at the end "
                         "and on Ctrl-C)")
    tr.set_defaults(func=cmd_train)


def _add_demo_command(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="generate for three held-out prompts with the default model")
    demo.add_argument("--model", type=Path, default=None,
                      help=f"model folder (default: {BUNDLED_MODEL})")
    demo.add_argument("--max-new-tokens", type=int, default=128,
                      help="generated tokens per prompt, at most")
    _add_compile_cache_option(demo)
    demo.set_defaults(func=cmd_demo)


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/serving.md)")
    srv.add_argument("--model", type=Path, default=None,
                     help=f"model folder (default: {BUNDLED_MODEL})")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* requests (default: none)")
    srv.add_argument("--mode", choices=MODES, default="focus", help="decoding mode")
    _add_commit_refresh_option(srv)
    _add_compile_cache_option(srv)
    srv.add_argument("--max-batch", type=int, default=None,
                     help=f"slots decoded together (default: {SERVE_CPU_SHAPE[0]} on a CPU, "
                          f"{SERVE_SLOTS} elsewhere)")
    srv.add_argument("--max-queue", type=int, default=256,
                     help="requests that may wait for a slot; beyond it: 429 with Retry-After")
    srv.add_argument("--max-model-len", type=int, default=None,
                     help=f"prompt + generated tokens per request (cache positions per slot; "
                          f"default: {SERVE_CPU_SHAPE[1]} on a CPU, elsewhere the model's "
                          f"max_position_embeddings, at most {SERVE_CONTEXT}; never more than "
                          f"the model's)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model's name in the API (default: the model folder's name)")
    srv.add_argument("--bucket-ladder", default=None,
                     help="compaction bucket sizes as fractions of slots x block, comma-separated "
                          "(fewer: faster warm-up, more padding; default: the platform's, "
                          f"{','.join(map(str, SERVE_CPU_LADDER))} at the CPU's default slots)")
    srv.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                     help="weights' dtype (default: the model's)")
    _add_kernels_option(srv)
    _add_kv_cache_options(srv)
    srv.add_argument("--round-interrupts", action=argparse.BooleanOptionalAction, default=True,
                     help="end a running decode round at the next step when a request arrives "
                          "for a free slot")
    srv.add_argument("--free-slot-round-steps", type=int, default=None,
                     help="steps per round while a slot is free and nothing waits (default: "
                          f"{GenerationConfig.steps_per_round} with round interrupts, which admit "
                          f"arrivals at once, else {GenerationConfig.free_slot_round_steps})")
    srv.add_argument("--grace-period", type=float, default=30.0,
                     help="seconds running requests get to finish on SIGTERM before they are aborted")
    srv.add_argument("--mesh", default=None,
                     help="shard over devices: data=D,model=M (slots over data, heads/MLP over "
                          "model; default: one device)")
    srv.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"),
                     default="info", help="uvicorn's log level")
    _add_quantize_options(srv)
    srv.set_defaults(func=cmd_serve)


def _add_compile_check_command(sub: argparse._SubParsersAction) -> None:
    cc = sub.add_parser("compile-check", help="compile every program for a TPU slice, here, "
                                              "and check that it fits the chips' HBM")
    cc.add_argument("--topology", required=True,
                    help="TPU slice as libtpu names it: v5e:1x1, v5e:2x4, v6e:2x4, v5p:2x2x1, ...")
    cc.add_argument("--geometry", choices=GEOMETRY_NAMES, default=None,
                    help="a named model geometry (one of --geometry and --model is required; "
                         "default: none)")
    cc.add_argument("--model", type=Path, default=None,
                    help="a model folder, its config.json (default: none, see --geometry)")
    cc.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="weights' dtype (default: bfloat16 for a geometry, else the model's)")
    cc.add_argument("--batch", type=int, default=64, help="slots decoded together")
    cc.add_argument("--max-len", type=int, default=4096, help="cache positions per slot")
    cc.add_argument("--mode", choices=MODES, default="focus", help="decoding mode")
    cc.add_argument("--mesh", default=None,
                    help="data=D,expert=X,model=M over the slice's chips (needed beyond one chip; "
                         "default: one chip)")
    cc.add_argument("--block-size", type=int, default=None,
                    help="block size (default: the model's)")
    cc.add_argument("--bucket-ladder", default=None,
                    help="compaction bucket sizes as fractions of slots x block (default: the "
                         "engine's 16 buckets)")
    cc.add_argument("--prompt-buckets", default="all",
                    help="prefill at every prompt bucket (all), at the buckets of these "
                         "comma-separated prompt lengths, or none")
    cc.add_argument("--prefill-batch", type=int, default=None,
                    help="prompts per prefill call (default: the engine's, min(batch, 8))")
    cc.add_argument("--kernels", choices=("pallas_tpu", "xla"), default=None,
                    help="attention and importance kernels (default: the TPU's, pallas_tpu)")
    cc.add_argument("--hbm-gib", type=float, default=None,
                    help="HBM a program may use per chip (default: the chip's)")
    _add_quantize_options(cc)
    _add_kv_cache_options(cc)
    cc.set_defaults(func=cmd_compile_check)


PROMPT_EXIT_COMMANDS = ("generate", "demo", "eval", "bench", "compile-check")
"""Commands that Ctrl-C ends within a second even inside a compile (:mod:`focus_jax.ctrl_c`):
they leave nothing half-written. ``train`` saves a checkpoint on Ctrl-C, ``serve`` drains, and
``convert`` finishes its folder or removes it: those end when Python sees the interrupt."""


USER_ERRORS = (ConfigError, RequestError, OSError, ValueError)
"""What the CLI reports as one line and status 2: bad options, inputs or files."""


def error_line(err: BaseException) -> str:
    return f"focus-jax: error: {err}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompt = args.command in PROMPT_EXIT_COMMANDS
    with ctrl_c.exit_promptly() if prompt else contextlib.nullcontext():
        try:
            return args.func(args)
        except USER_ERRORS as err:
            print(error_line(err), file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C: as a shell reports a process ended by SIGINT
            print(ctrl_c.MESSAGE, file=sys.stderr, flush=True)
            if prompt:
                ctrl_c.exit_now()
            return 130


if __name__ == "__main__":
    sys.exit(main())
