"""The task suite: answers are right, the held-out split is stable, scoring is exact."""

import re

from focus_jax import tasks


def _story_answer(question: str) -> int:
    count = int(re.match(r"\w+ has (\d+) ", question).group(1))
    for verb, n in re.findall(r"(gets|gives away) (\d+)", question):
        count += int(n) if verb == "gets" else -int(n)
    return count


def test_worked_answers_are_correct_from_the_question_alone():
    for index in range(300):
        for task in tasks.WORKED:
            example = tasks.make_example(task, 0, index)
            q, final = example.question, tasks.final_answer(example.answer)
            items = q.split(": ", 1)[-1].split()
            if task == "worked_copy":
                expected = " ".join(items)
            elif task == "worked_reverse":
                expected = " ".join(items[::-1])
            elif task == "worked_sort":
                expected = " ".join(sorted(items))
            elif task == "worked_recall":
                key = re.match(r"Recall (\w):", q).group(1)
                expected = dict(pair.split("=") for pair in items)[key]
            elif task == "worked_add":
                expected = str(sum(map(int, items[0].split("+"))))
            else:
                expected = str(_story_answer(q))
            assert final == expected, (example, expected)
            # Every sum written in the working is right.
            for *terms, total in re.findall(r"(\d+) ([+-]) (\d+)(?: \+ (\d+))? = (\d+)",
                                            example.answer):
                a, op, b, carry = terms
                value = int(a) + int(b) if op == "+" else int(a) - int(b)
                assert value + int(carry or 0) == int(total), example


def test_worked_answers_vary_in_their_words_not_their_final_answer():
    for task in tasks.WORKED:
        workings = set()
        for index in range(400):
            example = tasks.make_example(task, 0, index)
            working = example.answer.split(tasks.ANSWER_MARK)[0]
            workings.add(re.sub(r"\b[a-z]\b|\d+", "#", working))
        # Many phrasings of the same kind of question (the working's word choice is random).
        assert len(workings) > 50, (task, len(workings))
    story = [tasks.make_example("story", 0, i).answer.split(". ")[0] for i in range(200)]
    assert len({re.sub(r"\d+|[A-Z]\w+|apples|books|coins|pens|cards|shells|stamps|marbles",
                       "#", s) for s in story}) == 4  # each opening phrasing occurs


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
    assert tasks.held_out(10, tasks=("story", "copy")) == held
    assert len(held) == 20 and all(tasks.is_held_out(e.question) for e in held)
    stream = tasks.training_stream(0, ("story",))
    assert not any(tasks.is_held_out(next(stream).question) for _ in range(300))
