"""A deterministic suite of small tasks with exact-match answers, for training and evaluation.

Tasks of graded difficulty (the default suite): copying, reversal and sorting of lists of
numbers, key-value recall, multi-digit addition, and three chains whose every step depends on
the one before (two-step word problems answered with their working, Fibonacci terms mod 100,
left-to-right arithmetic with its working); prefix sums are an extra. Every example is a
function of ``(task, seed, index)``; an example belongs to the held-out split when a hash of its
question says so, and the training stream skips those, so no held-out question is ever trained
on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Iterator

LETTERS = "abcdefghijklmnopqrstuvwxyz"
NAMES = ("Ana", "Ben", "Cai", "Dev", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kim", "Leo")
ITEMS = ("apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles")
HELD_OUT_PERCENT = 10


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    question: str
    answer: str


def _numbers(rng: random.Random, low: int, high: int, max_digits: int = 3) -> list[str]:
    # Numbers of one to three digits (one token per digit), so items have different lengths.
    count = rng.randint(low, high)
    return [str(rng.randint(0, 10 ** rng.randint(1, max_digits) - 1)) for _ in range(count)]


def _copy(rng: random.Random) -> tuple[str, str]:
    numbers = " ".join(_numbers(rng, 3, 6))
    return f"Copy: {numbers}", numbers


def _reverse(rng: random.Random) -> tuple[str, str]:
    numbers = _numbers(rng, 3, 8)
    return f"Reverse: {' '.join(numbers)}", " ".join(reversed(numbers))


def _sort(rng: random.Random) -> tuple[str, str]:
    numbers = sorted(map(int, _numbers(rng, 3, 8, max_digits=2)))
    shuffled = numbers[:]
    rng.shuffle(shuffled)
    return f"Sort: {' '.join(map(str, shuffled))}", " ".join(map(str, numbers))


def _recall(rng: random.Random) -> tuple[str, str]:
    keys = rng.sample(LETTERS, rng.randint(3, 5))
    values = [rng.randint(10, 99) for _ in keys]
    asked = rng.randrange(len(keys))
    pairs = " ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))
    return f"Recall {keys[asked]}: {pairs}", str(values[asked])


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return f"Add: {a}+{b}", str(a + b)


def _word_problem(rng: random.Random) -> tuple[str, str]:
    # Two steps, answered with the working: each result is computed from the one before.
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    c = rng.randint(1, a + b)
    return (f"{name} has {a} {item}, gets {b} more and gives away {c}. How many {item} does "
            f"{name} have now?",
            f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}. {name} has {a + b - c} {item}.")


def _fibonacci(rng: random.Random) -> tuple[str, str]:
    # Each term is the sum of the two before it (mod 100): a chain no single forward pass can
    # unroll, so a model decodes it a term or two at a time, as it would text.
    terms = [rng.randint(0, 99), rng.randint(0, 99)]
    while len(terms) < 10:
        terms.append((terms[-1] + terms[-2]) % 100)
    return f"Fibonacci mod 100: {terms[0]} {terms[1]}", " ".join(map(str, terms[2:]))


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    # Left to right, one operation per step, each starting from the result before it.
    value = rng.randint(1, 50)
    expression, steps = str(value), []
    for _ in range(rng.randint(2, 4)):
        operand = rng.randint(1, 50)
        op = "-" if operand <= value and rng.random() < 0.5 else "+"
        result = value - operand if op == "-" else value + operand
        expression += f"{op}{operand}"
        steps.append(f"{value}{op}{operand}={result}")
        value = result
    return f"Compute: {expression}", ", ".join(steps)


def _prefix_sums(rng: random.Random) -> tuple[str, str]:
    # Each output number depends on the one before it: decoded left to right, a few per step,
    # like natural text, unlike copying (the dynamics FOCUS exists for).
    numbers = [rng.randint(1, 30) for _ in range(rng.randint(4, 7))]
    sums = [sum(numbers[:i + 1]) for i in range(len(numbers))]
    return f"Prefix sums: {' '.join(map(str, numbers))}", " ".join(map(str, sums))


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "copy": _copy, "reverse": _reverse, "sort": _sort, "recall": _recall, "add": _add,
    "word_problem": _word_problem, "fibonacci": _fibonacci, "arithmetic": _arithmetic,
    "prefix_sums": _prefix_sums,
}
SUITE = ("copy", "reverse", "sort", "recall", "add", "word_problem", "fibonacci", "arithmetic")
"""The default suite (the bundled model's training and evaluation tasks); ``prefix_sums`` is an
extra, harder task (see docs/quality.md)."""


def is_held_out(question: str) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELD_OUT_PERCENT


def make_example(task: str, seed: int, index: int) -> Example:
    rng = random.Random(f"{task}/{seed}/{index}")
    question, answer = TASKS[task](rng)
    return Example(task, question, answer)


def training_stream(seed: int = 0, tasks: tuple[str, ...] = SUITE) -> Iterator[Example]:
    """An endless, deterministic stream of training examples, tasks interleaved, held-out
    questions skipped."""
    index = 0
    while True:
        for task in tasks:
            example = make_example(task, seed, index)
            if not is_held_out(example.question):
                yield example
        index += 1


def held_out(per_task: int, seed: int = 1_000_003,
             tasks: tuple[str, ...] = SUITE) -> list[Example]:
    """``per_task`` held-out examples of each task (distinct questions, never trained on)."""
    out = []
    for task in tasks:
        seen: set[str] = set()
        index = 0
        while len(seen) < per_task:
            example = make_example(task, seed, index)
            index += 1
            if is_held_out(example.question) and example.question not in seen:
                seen.add(example.question)
                out.append(example)
    return out


def exact_match(prediction: str, answer: str) -> bool:
    return prediction.strip() == answer.strip()
