"""The task suite: answers are right, the held-out split is stable, scoring is exact."""

import re

from focus_jax import tasks


def test_story_answers_are_correct_and_phrased_in_varied_ways():
    phrasings = set()
    for index in range(200):
        example = tasks.make_example("story", 0, index)
        name, a, item, b, c = re.match(r"(\w+) has (\d+) (\w+), gets (\d+) more and gives away "
                                       r"(\d+)\.", example.question).groups()
        a, b, c = int(a), int(b), int(c)
        assert tasks.final_answer(example.answer) == str(a + b - c)
        assert f"{a} + {b} = {a + b}" in example.answer
        assert f"{a + b} - {c} = {a + b - c}" in example.answer
        first = example.answer.split(". ")[0]
        phrasings.add(re.sub(r"\d+", "#", first.replace(name, "N").replace(item, "I")))
    assert len(phrasings) == 4, phrasings  # every phrasing of the first sentence occurs


def test_exact_match_on_final_answers_and_whole_answers():
    reference = "Ana starts with 3 pens. 3 + 4 = 7. 7 - 2 = 5. #### 5"
    assert tasks.exact_match("At first Ana has 3 pens. whatever #### 5 ", reference)
    assert not tasks.exact_match("... #### 6", reference)
    assert not tasks.exact_match("5", reference)  # the answer line is part of the format
    assert tasks.exact_match(" q l v ", "q l v")
    assert not tasks.exact_match("q l v v", "q l v")


def test_examples_are_deterministic_and_held_out_split_is_disjoint():
    for task in tasks.TASKS:
        assert tasks.make_example(task, 7, 3) == tasks.make_example(task, 7, 3)
    held = tasks.held_out(10, tasks=("story", "copy"))
    assert len(held) == 20 and all(tasks.is_held_out(e.question) for e in held)
    stream = tasks.training_stream(0, ("story",))
    assert not any(tasks.is_held_out(next(stream).question) for _ in range(300))
