"""Training batches: (prompt, response) pairs tokenized with the chat template, EOS-padded.

A batch is a pure function of its index (``source.batch(i)``), so a resumed run sees exactly the
batches an uninterrupted run would have seen; ``source.identity()`` says what the batches are
made of, so that a run is resumed only on the same data.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import random
import signal
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from focus_jax import tasks
from focus_jax.config import ConfigError
from focus_jax.model import Model
from focus_jax.prompts import read_lines


class BatchSource(Protocol):
    def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``tokens int32 [batch, length]`` and ``trainable bool [batch, length]``."""
        ...

    def identity(self) -> dict[str, Any]:
        """What determines the batches, as JSON values (recorded in a run's ``run.json``)."""
        ...


def _check_shape(batch_size: int, length: int) -> None:
    if batch_size < 1 or length < 1:
        raise ConfigError(f"batch_size and length must be >= 1, got {batch_size} and {length}")


def encode_pairs(tokenizer: Any, prompts: Sequence[str], responses: Sequence[str],
                 length: int) -> list[tuple[list[int], int] | None]:
    """Each pair as prompt (chat template) + response + EOS padding to ``length``, with where the
    response starts; None for a pair that does not fit. One batched tokenizer call per side:
    the same ids as ``encode_prompt`` gives one prompt at a time, several times faster."""
    if getattr(tokenizer, "chat_template", None):
        texts = tokenizer.apply_chat_template([[{"role": "user", "content": p}] for p in prompts],
                                              add_generation_prompt=True, tokenize=False)
    else:
        texts = list(prompts)
    prompt_ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(list(responses), add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    out: list[tuple[list[int], int] | None] = []
    for prompt, response in zip(prompt_ids, response_ids, strict=True):
        ids = [*prompt, *response, eos]
        # Everything after the response is EOS: the model learns to end, and with confidence.
        out.append(None if len(ids) > length else (ids + [eos] * (length - len(ids)), len(prompt)))
    return out


def _pack(pairs: list[tuple[list[int], int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.array([ids for ids, _ in pairs], np.int32)
    trainable = np.arange(length)[None, :] >= np.array([start for _, start in pairs])[:, None]
    return tokens, trainable


class TaskSource:
    """Batches drawn from the generated task suite (held-out questions never appear).

    With ``trim_multiple`` (the block size, say), batch ``i`` holds examples of task
    ``i mod tasks`` only and is as long as its longest pair rounded up to that multiple, not
    ``length``: tasks with short answers are not padded to the longest task's length. The
    training step then compiles once per distinct length (a few multiples of the block size).
    """

    def __init__(self, model: Model, batch_size: int, length: int, seed: int = 0,
                 task_names: tuple[str, ...] = tasks.SUITE, trim_multiple: int | None = None):
        _check_shape(batch_size, length)
        # The tokenizer, not the model: the source is sent to ``Prefetch``'s worker processes.
        self.tokenizer = model.tokenizer
        self.batch_size, self.length, self.seed = batch_size, length, seed
        self.task_names, self.trim_multiple = task_names, trim_multiple

    def identity(self) -> dict[str, Any]:
        return {"data": f"tasks {','.join(self.task_names)}", "batch_size": self.batch_size,
                "seq_len": self.length, "data_seed": self.seed,
                "trim_multiple": self.trim_multiple}

    def example(self, index: int, task: str | None = None) -> tasks.Example:
        task = task or self.task_names[index % len(self.task_names)]
        attempt = 0
        while True:
            example = tasks.make_example(task, self.seed, index + attempt * (1 << 40))
            if not tasks.is_held_out(example.question):
                return example
            attempt += 1

    def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start = index * self.batch_size
        task = self.task_names[index % len(self.task_names)] if self.trim_multiple else None
        examples = [self.example(i, task) for i in range(start, start + self.batch_size)]
        pairs = encode_pairs(self.tokenizer, [e.question for e in examples],
                             [e.answer for e in examples], self.length)
        for example, pair in zip(examples, pairs, strict=True):
            if pair is None:
                raise ValueError(f"sequence length {self.length} is too short for {example}")
        if not self.trim_multiple:
            return _pack(pairs, self.length)
        eos = self.tokenizer.eos_token_id
        # Each pair ends with one EOS of its own before the padding (EOS too).
        longest = max(len(ids) - _trailing(ids, eos) + 1 for ids, _ in pairs)
        keep = min(-(-longest // self.trim_multiple) * self.trim_multiple, self.length)
        return _pack([(ids[:keep], begin) for ids, begin in pairs], keep)


_worker_source: BatchSource | None = None


def _start_worker(source: BatchSource) -> None:
    global _worker_source
    _worker_source = source
    # Ctrl-C reaches the whole process group: the training process saves and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_batch(index: int) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_source is not None
    return _worker_source.batch(index)


class Prefetch:
    """``source``'s batches computed ahead in ``workers`` processes: the same batches (a batch
    is a function of its index), while the accelerator runs the current step.

    Generating and tokenizing a batch of worked answers takes tens of milliseconds of Python,
    as long as a small model's training step; one process would leave the accelerator waiting.
    The workers are spawned (not forked: the parent runs JAX's threads) and get the source
    once; use as a context manager, or call ``close``.
    """

    def __init__(self, source: BatchSource, workers: int, depth: int | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.depth = depth or 2 * workers
        self.source = source
        self._pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"),
                                         initializer=_start_worker, initargs=(source,))
        self._pending: dict[int, Future] = {}

    def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        for stale in [i for i in self._pending if not index <= i < index + self.depth]:
            self._pending.pop(stale).cancel()
        for ahead in range(index, index + self.depth):
            if ahead not in self._pending:
                self._pending[ahead] = self._pool.submit(_worker_batch, ahead)
        return self._pending.pop(index).result()

    def identity(self) -> dict[str, Any]:
        return self.source.identity()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
        self._pending.clear()

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _trailing(ids: list[int], value: int) -> int:
    count = 0
    while count < len(ids) and ids[-1 - count] == value:
        count += 1
    return count


def read_pairs(path: Path) -> tuple[list[tuple[str, str]], str]:
    """The (prompt, response) pairs of a JSON-lines file, and the SHA-256 of its bytes. Any
    problem is a ``ConfigError`` naming the file and line."""
    lines, content = read_lines(path, 'a JSON-lines file of {"prompt": ..., "response": ...} '
                                      'objects')
    pairs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{number}: not valid JSON ({err.msg} at column "
                              f"{err.colno})") from None
        if not isinstance(record, dict) or "prompt" not in record or "response" not in record:
            raise ConfigError(f"{path}:{number}: each line must be a JSON object with "
                              f"'prompt' and 'response'")
        if not isinstance(record["prompt"], str) or not isinstance(record["response"], str):
            raise ConfigError(f"{path}:{number}: 'prompt' and 'response' must be strings")
        pairs.append((record["prompt"], record["response"]))
    return pairs, hashlib.sha256(content).hexdigest()


class PairSource:
    """Batches from user data: a JSON-lines file of ``{"prompt": ..., "response": ...}``.

    Each epoch is a seeded shuffle; pairs longer than ``length`` are dropped (and counted).
    """

    def __init__(self, model: Model, path: str | Path, batch_size: int, length: int,
                 seed: int = 0):
        _check_shape(batch_size, length)
        self.batch_size, self.length, self.seed = batch_size, length, seed
        self._epoch_order: tuple[int, list[int]] = (-1, [])
        records, self.sha256 = read_pairs(Path(path))
        encoded = encode_pairs(model.tokenizer, [p for p, _ in records],
                               [r for _, r in records], length) if records else []
        self.pairs = [pair for pair in encoded if pair is not None]
        self.dropped = len(encoded) - len(self.pairs)
        if not self.pairs:
            raise ConfigError(f"{path}: no usable pairs (dropped {self.dropped} longer than "
                              f"{length} tokens)")

    def identity(self) -> dict[str, Any]:
        return {"data": f"a file of SHA-256 {self.sha256[:16]}...", "batch_size": self.batch_size,
                "seq_len": self.length, "data_seed": self.seed}

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.pairs)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        chosen = []
        for i in range(index * self.batch_size, (index + 1) * self.batch_size):
            epoch, position = divmod(i, len(self.pairs))
            chosen.append(self.pairs[self._order(epoch)[position]])
        return _pack(chosen, self.length)
