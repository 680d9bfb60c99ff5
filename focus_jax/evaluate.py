"""Quality and compute of the three decoding modes on the held-out task suite."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from focus_jax import tasks
from focus_jax.api import encode_prompt
from focus_jax.config import GenerationConfig
from focus_jax.engine import Engine, cache_length
from focus_jax.model import Model


@dataclasses.dataclass
class ModeReport:
    """One mode's results over the suite."""

    mode: str
    threshold: float
    exact_match: dict[str, float]
    """Per task, in [0, 1]."""
    examples: int
    generated_tokens: int
    decoded_per_step: float
    early_token_layers_per_token: float
    """Token-layers through layers 0-1 per generated token."""
    late_token_layers_per_token: float
    """Token-layers through layers >= 2 per generated token."""
    wall_seconds: float
    """Decoding time after warm-up (compilation excluded)."""

    @property
    def average_exact_match(self) -> float:
        return sum(self.exact_match.values()) / len(self.exact_match)

    @property
    def token_layers_per_token(self) -> float:
        return self.early_token_layers_per_token + self.late_token_layers_per_token


def evaluate(model: Model, examples: Sequence[tasks.Example],
             modes: Sequence[str] = ("baseline", "delayed", "focus"), *, max_batch: int = 64,
             max_new_tokens: int = 32, alpha: float = 1.5,
             progress: bool = False) -> list[ModeReport]:
    """Decode every example in every mode (greedy, default thresholds) and score exact match."""
    prompts = [encode_prompt(model, ex.question) for ex in examples]
    block = model.config.block_size or 8
    cache_len = cache_length(block, max(len(p) for p in prompts) + max_new_tokens)
    reports = []
    layers = model.config.num_layers
    for mode in modes:
        config = GenerationConfig(mode=mode, block_size=block, alpha=alpha,
                                  max_new_tokens=max_new_tokens)
        engine = Engine(model, config, slots=min(max_batch, len(prompts)), cache_len=cache_len)
        engine.warmup()
        ids = [engine.submit(p) for p in prompts]
        start = time.perf_counter()
        results = engine.run(progress=progress)
        wall = time.perf_counter() - start
        stats = engine.stats
        per_task: dict[str, list[bool]] = {}
        for example, rid in zip(examples, ids, strict=True):
            per_task.setdefault(example.task, []).append(
                tasks.exact_match(results[rid].text or "", example.answer))
        generated = max(stats.generated_tokens, 1)
        reports.append(ModeReport(
            mode=mode, threshold=config.resolved_threshold,
            exact_match={t: sum(v) / len(v) for t, v in per_task.items()},
            examples=len(examples), generated_tokens=stats.generated_tokens,
            decoded_per_step=stats.decoded_tokens / max(
                sum(len(r.stats.decoded_per_step) for r in results.values()), 1),
            early_token_layers_per_token=2 * stats.processed_tokens / generated,
            late_token_layers_per_token=(layers - 2) * stats.retained_tokens / generated,
            wall_seconds=wall))
    return reports


def markdown(reports: Sequence[ModeReport]) -> str:
    """Two tables: exact match per task, and compute per mode."""
    task_names = list(reports[0].exact_match)
    head = "| mode (threshold) | " + " | ".join(task_names) + " | average |"
    lines = [head, "|" + "---|" * (len(task_names) + 2)]
    for r in reports:
        cells = " | ".join(f"{100 * r.exact_match[t]:.1f}" for t in task_names)
        lines.append(f"| {r.mode} ({r.threshold}) | {cells} | {100 * r.average_exact_match:.1f} |")
    lines += ["", "| mode | tokens decoded per step | token-layers / generated token (layers 0-1 + "
                  ">= 2 = total) | generated tokens | wall time (s) |", "|---|---|---|---|---|"]
    for r in reports:
        lines.append(
            f"| {r.mode} | {r.decoded_per_step:.2f} | {r.early_token_layers_per_token:.1f} + "
            f"{r.late_token_layers_per_token:.1f} = {r.token_layers_per_token:.1f} | "
            f"{r.generated_tokens} | {r.wall_seconds:.2f} |")
    return "\n".join(lines)
