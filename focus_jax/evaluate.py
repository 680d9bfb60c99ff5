"""Quality and compute of the decoding modes on the held-out task suite, per task and overall."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from focus_jax import tasks
from focus_jax.config import ConfigError, GenerationConfig, check_integer, mode_label
from focus_jax.engine import Engine, cache_length, run_to_completion, token_layer_split
from focus_jax.model import Model
from focus_jax.prompts import encode_prompt


@dataclasses.dataclass
class Counts:
    """What one mode did on a set of examples (one task's, or all of them)."""

    examples: int = 0
    correct: int = 0
    generated_tokens: int = 0
    decoded_tokens: int = 0
    denoising_steps: int = 0
    processed_tokens: int = 0
    """Token-steps through layers 0-1 (commit steps included)."""
    retained_tokens: int = 0
    """Token-steps through layers >= 2 (commit steps included)."""
    wall_seconds: float = 0.0
    """Decoding time after warm-up (compilation excluded)."""

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(dataclasses.astuple(self),
                                               dataclasses.astuple(other), strict=True)))

    @property
    def exact_match(self) -> float:
        return self.correct / max(self.examples, 1)

    @property
    def decoded_per_step(self) -> float:
        return self.decoded_tokens / max(self.denoising_steps, 1)

    def token_layers_per_token(self, num_layers: int) -> tuple[float, float]:
        """Token-layers per generated token through layers 0-1 and through layers >= 2."""
        generated = max(self.generated_tokens, 1)
        return token_layer_split(self.processed_tokens / generated,
                                 self.retained_tokens / generated, num_layers)


@dataclasses.dataclass
class ModeReport:
    """One mode's results, per task."""

    mode: str
    threshold: float
    num_layers: int
    tasks: dict[str, Counts]
    commit_refresh: bool = False

    @property
    def label(self) -> str:
        """The mode, and ``+ refresh`` where blocks were refreshed at commit."""
        return mode_label(self.mode, self.commit_refresh)

    @property
    def overall(self) -> Counts:
        return sum(self.tasks.values(), Counts())

    @property
    def average_exact_match(self) -> float:
        """Mean over tasks of their exact match (tasks weigh the same)."""
        return sum(c.exact_match for c in self.tasks.values()) / len(self.tasks)

    def summary(self) -> dict[str, Any]:
        """Plain numbers (for JSON): per task and overall."""
        def numbers(c: Counts) -> dict[str, float]:
            early, late = c.token_layers_per_token(self.num_layers)
            return {"exact_match": c.exact_match, "decoded_per_step": c.decoded_per_step,
                    "early_token_layers_per_token": early, "late_token_layers_per_token": late,
                    "token_layers_per_token": early + late,
                    "generated_tokens": c.generated_tokens, "wall_seconds": c.wall_seconds}

        return {"mode": self.mode, "threshold": self.threshold,
                "commit_refresh": self.commit_refresh,
                "tasks": {t: numbers(c) for t, c in self.tasks.items()},
                "overall": {**numbers(self.overall), "exact_match": self.average_exact_match}}


def evaluate(model: Model, examples: Sequence[tasks.Example],
             modes: Sequence[str] = ("baseline", "delayed", "focus"), *, max_batch: int = 64,
             max_new_tokens: int = 32, alpha: float = 1.5,
             commit_refresh: bool = GenerationConfig.commit_refresh,
             progress: bool = False) -> list[ModeReport]:
    """Decode every example in every mode (greedy, default thresholds) and score exact match.

    Each task runs on its own (one engine per mode, compiled once), so that its wall time and
    compute are its own. Raises ``ConfigError`` for no examples or a bad setting, before any
    decoding.
    """
    if not examples:
        raise ConfigError("no examples to evaluate: give at least one per task")
    if not modes:
        raise ConfigError("no modes to evaluate: give at least one of baseline, delayed, focus")
    check_integer("max_batch", max_batch, minimum=1)
    block = model.config.block_size or 8
    configs = [GenerationConfig(mode=mode, block_size=block, alpha=alpha,
                                max_new_tokens=max_new_tokens, commit_refresh=commit_refresh)
               for mode in modes]
    prompts = [encode_prompt(model, ex.question) for ex in examples]
    by_task: dict[str, list[int]] = {}
    for i, example in enumerate(examples):
        by_task.setdefault(example.task, []).append(i)
    cache_len = cache_length(block, max(len(p) for p in prompts) + max_new_tokens)
    slots = min(max_batch, max(len(v) for v in by_task.values()))
    reports = []
    for config in configs:
        engine = Engine(model, config, slots=slots, cache_len=cache_len)
        engine.warmup()
        counts = {}
        for task, indices in by_task.items():
            ids = [engine.add_request(prompts[i]) for i in indices]
            start = time.perf_counter()
            results = run_to_completion(engine, progress=progress)
            wall = time.perf_counter() - start
            c = Counts(examples=len(indices), wall_seconds=wall)
            for i, rid in zip(indices, ids, strict=True):
                result = results[rid]
                c.correct += tasks.exact_match(result.text or "", examples[i].answer)
                c.generated_tokens += len(result.token_ids)
                c.decoded_tokens += sum(result.stats.decoded_per_step)
                c.denoising_steps += result.stats.denoising_steps
                c.processed_tokens += result.stats.processed_tokens
                c.retained_tokens += result.stats.retained_tokens
            counts[task] = c
        reports.append(ModeReport(config.mode, config.resolved_threshold, model.config.num_layers,
                                  counts, config.commit_refresh))
    return reports


def markdown(reports: Sequence[ModeReport]) -> str:
    """Three tables: exact match per task; compute per mode; compute per task and mode."""
    task_names = list(reports[0].tasks)
    head = "| mode (threshold) | " + " | ".join(task_names) + " | average |"
    lines = [head, "|" + "---|" * (len(task_names) + 2)]
    for r in reports:
        cells = " | ".join(f"{100 * r.tasks[t].exact_match:.1f}" for t in task_names)
        lines.append(f"| {r.label} ({r.threshold}) | {cells} | {100 * r.average_exact_match:.1f} |")

    def compute_row(label: str, c: Counts, layers: int) -> str:
        early, late = c.token_layers_per_token(layers)
        return (f"| {label} | {c.decoded_per_step:.2f} | {early:.1f} + {late:.1f} = "
                f"{early + late:.1f} | {c.generated_tokens} | {c.wall_seconds:.2f} |")

    columns = (" | tokens decoded per step | token-layers / generated token (layers 0-1 + >= 2 "
               "= total) | generated tokens | wall time (s) |")
    lines += ["", "| mode" + columns, "|---|---|---|---|---|"]
    lines += [compute_row(r.label, r.overall, r.num_layers) for r in reports]
    lines += ["", "| task, mode" + columns, "|---|---|---|---|---|"]
    lines += [compute_row(f"{t}, {r.label}", r.tasks[t], r.num_layers)
              for t in task_names for r in reports]
    return "\n".join(lines)
