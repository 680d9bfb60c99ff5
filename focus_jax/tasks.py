"""A deterministic suite of small tasks with exact-match answers, for training and evaluation.

Tasks of graded difficulty: copying, reversal, sorting, key-value recall, multi-digit addition,
templated word problems (the default suite); prefix sums (an extra); and ``WORKED``, the same
kinds of task answered with their working in varied words and scored on the final answer.
Every example is a function of ``(task, seed, index)``; an example belongs to the held-out split
when a hash of its question says so, and the training stream skips those, so no held-out
question is ever trained on.
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
HELD_OUT_SEED = 1_000_003
"""The seed of the held-out questions that the evaluations report (any seed draws held-out
questions only: the split is by question)."""
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


def _say(rng: random.Random, *options: str) -> str:
    return rng.choice(options)


def _walked_answer(rng: random.Random, items: list[str], first: tuple[str, ...]) -> str:
    """The answer of a list task: ``items`` in order, after one of the ``first`` openings, each
    joined to the one before by a connector of random length (where an item lands depends on
    every earlier choice), then the final answer."""
    text = _say(rng, *first) + items[0]
    for item in items[1:]:
        text += _say(rng, ", then ", ", next ", " and then ", ", ", "; after it ") + item
    text += _say(rng, ".", ". Done.", ", the end.", ".")  # a plain "." two times in five
    return f"{text} {ANSWER_MARK} {' '.join(items)}"


# The worked tasks answer with their working in varied words, then the final answer after "####"
# (scored alone, as GSM8K is). The choice of words cannot be predicted and moves every later
# token, so, as in text, only a few tokens of a block are decodable at a time: the dynamics
# FOCUS is for (a model trained on the short-answer tasks decodes most of a block at once).

def _worked_copy(rng: random.Random) -> tuple[str, str]:
    letters = _letters(rng, 3, 10)
    return f"Copy: {' '.join(letters)}", _walked_answer(
        rng, letters, ("Letter by letter: ", "In order: ", "They are ", "First "))


def _worked_reverse(rng: random.Random) -> tuple[str, str]:
    letters = _letters(rng, 3, 8)
    return f"Reverse: {' '.join(letters)}", _walked_answer(
        rng, letters[::-1], ("From the end: ", "Backwards: ", "Last first: ", "Starting at "))


def _worked_sort(rng: random.Random) -> tuple[str, str]:
    digits = sorted(rng.randint(0, 9) for _ in range(rng.randint(3, 7)))
    shuffled = rng.sample(digits, len(digits))
    return f"Sort: {' '.join(map(str, shuffled))}", _walked_answer(
        rng, list(map(str, digits)),
        ("Smallest first: ", "Going up: ", "In order: ", "From low to high: "))


def _worked_recall(rng: random.Random) -> tuple[str, str]:
    keys = rng.sample(LETTERS, rng.randint(3, 5))
    values = [rng.randint(10, 99) for _ in keys]
    asked = rng.randrange(len(keys))
    pairs = " ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))
    steps = [f"{k} is {v}, " + _say(rng, "not it", "no", "skip", f"not {keys[asked]}")
             for k, v in zip(keys[:asked], values[:asked], strict=True)]
    steps.append(f"{keys[asked]} is {values[asked]}, " + _say(rng, "found it", "yes", "that one"))
    working = _say(rng, "Looking for ", "Find ", "We want ") + keys[asked] + ". " + "; ".join(steps)
    return f"Recall {keys[asked]}: {pairs}", f"{working}. {ANSWER_MARK} {values[asked]}"


def _worked_add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    carry, parts = 0, []
    columns = ("ones", "tens", "hundreds")
    for place in range(max(len(str(a)), len(str(b)))):
        da, db = a // 10 ** place % 10, b // 10 ** place % 10
        total = da + db + carry
        terms = f"{da} + {db}" + (f" + {carry}" if carry else "")
        head = _say(rng, f"{columns[place].capitalize()}: ", f"The {columns[place]} give ",
                    f"In the {columns[place]}, ", f"Then the {columns[place]}: ")
        carry = total // 10
        tail = (_say(rng, f", write {total % 10} and carry 1", f", keep {total % 10}, carry 1",
                     f", so {total % 10} down and 1 up") if carry else "")
        parts.append(f"{head}{terms} = {total}{tail}.")
    if carry:
        parts.append(_say(rng, "The carry makes 1 more digit.", "Last, the 1 we carried.",
                          "Then write the carried 1."))
    return f"Add: {a}+{b}", f"{' '.join(parts)} {ANSWER_MARK} {a + b}"


def _story(rng: random.Random) -> tuple[str, str]:
    # A three-step word problem answered in words, each clause in one of several phrasings.
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(2, 40)
    question = [f"{name} has {count} {item}"]
    working = [_say(rng, f"{name} starts with {count} {item}.", f"At first {name} has {count}.",
                    f"There are {count} {item} to begin with.", f"{name} has {count} at the start.")]
    for _ in range(3):
        opener = _say(rng, "Then ", "Next, ", "After that, ", "")
        if rng.random() < 0.5 or count < 2:
            n = rng.randint(2, 30)
            new = count + n
            question.append(f"gets {n} more")
            clause = _say(rng, f"{name} gets {n} more", f"{n} more arrive", f"{name} is given {n}",
                          f"{name} adds {n}")
            link = _say(rng, ", so ", ". That makes ", ": ", ", giving ")
            equation = f"{count} + {n} = {new}"
        else:
            n = rng.randint(1, count - 1)
            new = count - n
            question.append(f"gives away {n}")
            clause = _say(rng, f"{name} gives away {n}", f"{n} are given away",
                          f"{name} hands out {n}", f"{n} go to a friend")
            link = _say(rng, ", so ", ". That leaves ", ": ", ", leaving ")
            equation = f"{count} - {n} = {new}"
        if not opener:
            clause = clause[0].upper() + clause[1:]
        end = _say(rng, ".", f" {item}.", " in all.", " now.")
        working.append(f"{opener}{clause}{link}{equation}{end}")
        count = new
    final = _say(rng, f" So {name} has {count}.", f" The answer is {count}.", "")
    asked = ", ".join(question[:-1]) + " and " + question[-1]
    return (f"{asked}. How many {item} does {name} have now?",
            f"{' '.join(working)}{final} {ANSWER_MARK} {count}")


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "copy": _copy, "reverse": _reverse, "sort": _sort, "recall": _recall, "add": _add,
    "word_problem": _word_problem, "prefix_sums": _prefix_sums, "story": _story,
    "worked_copy": _worked_copy, "worked_reverse": _worked_reverse, "worked_sort": _worked_sort,
    "worked_recall": _worked_recall, "worked_add": _worked_add,
}
WORKED = ("worked_copy", "worked_reverse", "worked_sort", "worked_recall", "worked_add", "story")
"""The same kinds of task answered with their working in varied words (scored on the final
answer after ``####``)."""
SUITE = ("copy", "reverse", "sort", "recall", "add", "word_problem")
"""The default suite (the bundled model's training and evaluation tasks). Extras: ``prefix_sums``,
harder (see docs/quality.md), and the ``WORKED`` suite above."""


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


def held_out(per_task: int, seed: int = HELD_OUT_SEED,
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
