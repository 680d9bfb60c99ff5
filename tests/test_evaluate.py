"""The held-out evaluation: exact-match scoring and per-task compute add up to the run's."""

from focus_jax import GenerationConfig, evaluate, generate, tasks
from focus_jax.testing import tiny_model


def test_scores_per_task_and_counts_match_an_independent_run():
    model = tiny_model(tokenizer=True, block_size=4, scale=3.0)
    questions = {"copy": ["Copy: a b", "Copy: c d e", "Copy: f"], "add": ["Add: 1+2", "Add: 30+4"]}
    # At most 3 slots, as evaluate's engine has (the largest task): the same programs serve both.
    config = GenerationConfig(mode="focus", block_size=4, max_new_tokens=8, max_batch=3)
    flat = [q for qs in questions.values() for q in qs]
    outputs, stats = generate(model, flat, config, return_stats=True)
    texts = dict(zip(flat, (r.text for r in outputs), strict=True))
    assert all(texts.values()) and len(set(texts.values())) == len(flat)  # a mix-up would show
    # Answers equal to the model's own output for the first example of each task, and an
    # answer it cannot have produced for the rest: exact match must be 1/3 and 1/2.
    examples = [tasks.Example(task, q, texts[q] if i == 0 else "\x00 never")
                for task, qs in questions.items() for i, q in enumerate(qs)]
    (report,) = evaluate.evaluate(model, examples, ("focus",), max_new_tokens=8)
    assert report.mode == "focus" and report.threshold == config.resolved_threshold
    assert abs(report.tasks["copy"].exact_match - 1 / 3) < 1e-9
    assert abs(report.tasks["add"].exact_match - 1 / 2) < 1e-9
    assert abs(report.average_exact_match - (1 / 3 + 1 / 2) / 2) < 1e-9
    # Per-task runs do the same work as one run over everything (decoding is per sequence).
    overall = report.overall
    assert overall.examples == len(flat)
    assert overall.generated_tokens == stats.generated_tokens
    assert overall.processed_tokens == stats.processed_tokens
    assert overall.retained_tokens == stats.retained_tokens
    assert overall.decoded_tokens == stats.decoded_tokens
    early, late = overall.token_layers_per_token(model.config.num_layers)
    assert early == 2 * stats.processed_tokens / stats.generated_tokens
    assert late == (model.config.num_layers - 2) * stats.retained_tokens / stats.generated_tokens
    table = evaluate.markdown([report])
    assert "| copy, focus + refresh |" in table and "| add, focus + refresh |" in table
