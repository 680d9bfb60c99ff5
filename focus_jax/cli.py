"""The ``focus-jax`` command line: ``generate``, ``convert``, ``demo`` (and more as they land)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from focus_jax.config import DEFAULT_THRESHOLD, MODES, UNMASKING_RULES, ConfigError, GenerationConfig
from focus_jax.engine import RequestError, RunStats

BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "checkpoints" / "focus-tiny"
DEMO_PROMPTS = ("What is 12 + 30?", "Reverse the word 'focus'.")


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
    parser.add_argument("--block-size", type=int, default=None,
                        help="block size (default: the model's)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--unmasking", choices=UNMASKING_RULES, default="low_confidence_dynamic")
    parser.add_argument("--denoising-steps", type=int, default=None,
                        help="static/sequential rules: unmask ceil(block/steps) tokens per step")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=None, help="slots decoded together")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    parser.add_argument("--no-chat", action="store_true",
                        help="do not apply the tokenizer's chat template")
    parser.add_argument("--stats", action="store_true", help="print decoding statistics")


def _generation_config(args: argparse.Namespace) -> GenerationConfig:
    return GenerationConfig(
        mode=args.mode, block_size=args.block_size, threshold=args.threshold, alpha=args.alpha,
        unmasking=args.unmasking, denoising_steps=args.denoising_steps,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, max_batch=args.max_batch)


def load_model(path: Path | None, dtype: str | None = None):
    """The model at ``path``; without one, the bundled model, else a random tiny one (noise)."""
    from focus_jax.checkpoint import load

    if path is not None:
        return load(path, dtype=dtype)
    if (BUNDLED_MODEL / "config.json").exists():
        return load(BUNDLED_MODEL, dtype=dtype)
    from focus_jax.testing import tiny_model

    print("note: no --model given and no bundled model found: using a tiny RANDOM model, "
          "its output is untrained noise", file=sys.stderr)
    return tiny_model(tokenizer=True, block_size=8)


def format_stats(stats: RunStats, num_layers: int) -> str:
    """A few lines describing a run."""
    steps = max(stats.steps, 1)
    lines = [
        f"steps {stats.steps} (rounds {stats.rounds}), generated {stats.generated_tokens} tokens "
        f"in {stats.wall_seconds:.2f}s ({stats.tokens_per_second:.1f} tok/s)",
        f"per step: processed {stats.processed_tokens / steps:.2f} tokens (layers 0-1), "
        f"retained {stats.retained_tokens / steps:.2f} (layers >= 2), "
        f"decoded {stats.decoded_tokens / steps:.2f}",
        f"token-layers per generated token: "
        f"{stats.token_layers(num_layers) / max(stats.generated_tokens, 1):.1f}",
        f"processed bucket histogram {dict(sorted(stats.processed_buckets.items()))}; "
        f"retained {dict(sorted(stats.retained_buckets.items()))}",
    ]
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> int:
    from focus_jax.api import generate

    model = load_model(args.model, args.dtype)
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line.rstrip("\n") for line in Path(args.prompts_file).read_text().splitlines()
                    if line.strip()]
    if not prompts:
        raise ConfigError("give --prompt TEXT (repeatable) or --prompts-file FILE")
    config = _generation_config(args)
    stream = len(prompts) == 1 and not args.no_stream
    printer = _StreamPrinter(model.tokenizer) if stream else None
    results, stats = generate(model, prompts, config, chat=not args.no_chat,
                              progress=not stream, on_tokens=printer, return_stats=True)
    if stream:
        printer.finish(results[0].token_ids)
    else:
        for prompt, result in zip(prompts, results, strict=True):
            print(f"### {prompt}\n{result.text}\n")
    if args.stats:
        print(format_stats(stats, model.config.num_layers), file=sys.stderr)
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

    out = convert(args.hf_dir, args.out_dir, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from focus_jax.api import generate

    model = load_model(args.model)
    config = GenerationConfig(mode="focus", max_new_tokens=args.max_new_tokens,
                              block_size=None if model.config.block_size else 8)
    for prompt in DEMO_PROMPTS:
        print(f">>> {prompt}")
        printer = _StreamPrinter(model.tokenizer)
        results, stats = generate(model, prompt, config, on_tokens=printer, return_stats=True)
        printer.finish(results[0].token_ids)
        print(format_stats(stats, model.config.num_layers) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="focus-jax", description=(
        "Block-diffusion language models in JAX with FOCUS eviction."))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts")
    _add_generation_options(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--no-stream", action="store_true", help="print at the end, not as it comes")
    gen.set_defaults(func=cmd_generate)

    conv = sub.add_parser("convert", help="convert a Hugging Face folder to an orbax folder")
    conv.add_argument("hf_dir", type=Path)
    conv.add_argument("out_dir", type=Path)
    conv.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    conv.set_defaults(func=cmd_convert)

    demo = sub.add_parser("demo", help="generate for two sample prompts with the default model")
    demo.add_argument("--model", type=Path, default=None)
    demo.add_argument("--max-new-tokens", type=int, default=32)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, RequestError, FileNotFoundError) as err:
        print(f"focus-jax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
