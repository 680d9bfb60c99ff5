"""A deterministic suite of small tasks with exact-match answers, for training and evaluation.

Tasks of graded difficulty: copying, reversal, sorting, key-value recall, multi-digit addition,
templated word problems (the default suite); prefix sums and word problems answered in varied
words (extras). Every example is a
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
ANSWER_MARK = "####"


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    question: str
    answer: str


def _letters(rng: random.Random, low: int, high: int) -> list[str]:
    # Spaced letters: one token each under a word-level tokenizer, so the task is about order.
    return [rng.choice(LETTERS) for _ in range(rng.randint(low, high))]


def _copy(rng: random.Random) -> tuple[str, str]:
    letters = " ".join(_letters(rng, 3, 10))
    return f"Copy: {letters}", letters


def _reverse(rng: random.Random) -> tuple[str, str]:
    letters = _letters(rng, 3, 8)
    return f"Reverse: {' '.join(letters)}", " ".join(reversed(letters))


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 7))]
    return f"Sort: {' '.join(map(str, digits))}", " ".join(map(str, sorted(digits)))


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
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    if rng.random() < 0.5:
        return (f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?",
                str(a + b))
    a, b = max(a, b), min(a, b)
    return (f"{name} has {a} {item} and gives away {b}. How many {item} are left?", str(a - b))


def _prefix_sums(rng: random.Random) -> tuple[str, str]:
    # Each output number depends on the one before it: decoded left to right, a few per step,
    # like natural text, unlike copying (the dynamics FOCUS exists for).
    numbers = [rng.randint(1, 30) for _ in range(rng.randint(4, 7))]
    sums = [sum(numbers[:i + 1]) for i in range(len(numbers))]
    return f"Prefix sums: {' '.join(map(str, numbers))}", " ".join(map(str, sums))


def _story(rng: random.Random) -> tuple[str, str]:
    # A two-step word problem answered in words, each sentence in one of several phrasings of
    # different lengths, then the final answer after "####" (scored alone, as GSM8K is). Which
    # phrasing comes next cannot be known, and where the later tokens land depends on it, so
    # (as in text; still to be measured on a trained model) only a few tokens of a block should
    # be decodable at a time, where the other tasks let a model decode most of a block at once.
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    c = rng.randint(1, a + b)
    total, left = a + b, a + b - c
    sentences = (
        (f"{name} starts with {a} {item}.", f"At first {name} has {a} {item}.",
         f"In the beginning there are {a} {item}.", f"{name} has {a} {item} to begin with."),
        (f"After getting {b} more, {name} has {a} + {b} = {total} {item}.",
         f"Getting {b} more makes {a} + {b} = {total}.", f"Then {b} more arrive: {a} + {b} = {total}.",
         f"{a} + {b} = {total}, since {name} gets {b} more."),
        (f"Giving away {c} leaves {total} - {c} = {left}.",
         f"After giving {c} away, {name} has {total} - {c} = {left} {item}.",
         f"Then {c} are given away: {total} - {c} = {left}.",
         f"{total} - {c} = {left} are left once {c} are gone."),
    )
    working = " ".join(rng.choice(options) for options in sentences)
    return (f"{name} has {a} {item}, gets {b} more and gives away {c}. How many {item} does "
            f"{name} have now?", f"{working} #### {left}")


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "copy": _copy, "reverse": _reverse, "sort": _sort, "recall": _recall, "add": _add,
    "word_problem": _word_problem, "prefix_sums": _prefix_sums, "story": _story,
}
SUITE = ("copy", "reverse", "sort", "recall", "add", "word_problem")
"""The default suite (the bundled model's training and evaluation tasks). Extras: ``prefix_sums``,
harder (see docs/quality.md), and ``story``, word problems answered in varied words (its
exact match is on the final answer after ``####``)."""


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


def final_answer(text: str) -> str:
    """The part after the last ``####`` (the whole text if there is none), stripped."""
    return text.rsplit(ANSWER_MARK, 1)[-1].strip()


def exact_match(prediction: str, answer: str) -> bool:
    """Equal after stripping spaces; for answers with a ``####`` line, the final answers only
    (the working may be phrased in any way)."""
    if ANSWER_MARK in answer:
        return ANSWER_MARK in prediction and final_answer(prediction) == final_answer(answer)
    return prediction.strip() == answer.strip()
