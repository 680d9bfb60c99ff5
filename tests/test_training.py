"""The block-diffusion objective, the data pipeline and the training loop (resume)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focus_jax import tasks
from focus_jax.api import encode_prompt
from focus_jax.testing import tiny_model
from focus_jax.train import TaskSource, TrainConfig, block_diffusion_mask, train
from focus_jax.train.data import encode_pairs
from focus_jax.train.objective import frozen_by_delayed_cache, loss


def test_block_diffusion_mask_by_hand():
    mask = np.asarray(block_diffusion_mask(4, 2))
    noisy, clean = slice(0, 4), slice(4, 8)
    # Noisy block 1 (positions 2-3) sees noisy block 1 and clean block 0 only.
    assert mask[2, noisy].tolist() == [False, False, True, True]
    assert mask[2, clean].tolist() == [True, True, False, False]
    # Clean tokens are block-causal over the clean copy and never see the noisy copy.
    assert mask[4 + 1, clean].tolist() == [True, True, False, False]
    assert not mask[clean, noisy].any()


def test_truncated_view_hides_later_noisy_slots_of_the_block():
    mask = np.asarray(block_diffusion_mask(4, 2, jnp.array([[1, 0]])))[0]
    assert mask[2, 0:4].tolist() == [False, False, True, False]  # slot 3 hidden in block 1
    assert mask[0, 0:4].tolist() == [True, True, False, False]   # block 0 untouched


def test_stale_view_hides_the_block_beyond_the_next_slot_from_unmasked_queries():
    stale = jnp.array([[True, False, True, False]])
    mask = np.asarray(block_diffusion_mask(4, 4, stale=stale))[0]
    assert mask[0, 0:4].tolist() == [True, True, False, False]  # sees itself and slot 1
    assert mask[1, 0:4].tolist() == [True, True, True, True]    # a masked query: the block
    assert mask[2, 0:4].tolist() == [True, True, True, True]    # slot 3 is its next slot
    plain = np.asarray(block_diffusion_mask(4, 4))
    np.testing.assert_array_equal(mask[4:], plain[4:])          # the clean copy is unchanged
    model = tiny_model(tokenizer=True, block_size=4)
    tokens = jnp.asarray(np.random.default_rng(0).integers(5, 100, size=(2, 8)), jnp.int32)
    losses = [float(loss(model.module(), tokens, jnp.ones((2, 8), bool), jax.random.key(1), 4, 2,
                         stale_prob=p)[0]) for p in (0.0, 1.0)]
    assert losses[0] != losses[1]  # the option reaches the model's attention


def test_delayed_cache_freezes_unmasked_slots_whose_next_slot_is_unmasked_or_last():
    m = 2
    noisy = jnp.array([[7, m, 8, 9, m, 5, m, m]])
    frozen = frozen_by_delayed_cache(noisy, 4, m)
    assert frozen[0].tolist() == [False, False, True, True, False, False, False, False]


def test_stale_history_hides_the_clean_block_beyond_the_next_slot():
    stale_history = jnp.array([[True, True, True, True, False, False]])
    mask = np.asarray(block_diffusion_mask(6, 3, stale_history=stale_history))[0]
    clean = slice(6, 12)
    assert mask[6 + 0, clean].tolist() == [True, True, False, False, False, False]
    assert mask[6 + 3, clean].tolist() == [True, True, True, True, True, False]
    assert mask[6 + 4, clean].tolist() == [True] * 6             # not stale: its whole block
    plain = np.asarray(block_diffusion_mask(6, 3))
    np.testing.assert_array_equal(mask[:6], plain[:6])          # the noisy copy is unchanged


def test_delayed_views_leave_other_options_random_streams_alone():
    model = tiny_model(tokenizer=True, block_size=4)
    tokens = jnp.asarray(np.random.default_rng(0).integers(5, 100, size=(2, 8)), jnp.int32)
    trainable = jnp.ones((2, 8), bool)

    def value(**options):
        return float(loss(model.module(), tokens, trainable, jax.random.key(1), 4, 2,
                          truncate_prob=0.5, stale_prob=0.5, **options)[0])

    assert value(delayed_prob=0.0) == value()
    assert value(delayed_prob=1.0) != value()  # the option reaches the model's attention


def test_probabilities_outside_zero_one_are_refused():
    with pytest.raises(ValueError, match="delayed_prob"):
        TrainConfig(delayed_prob=1.5)


def test_loss_ignores_prompt_tokens_and_padding_mask_is_respected():
    model = tiny_model(tokenizer=True, block_size=4)
    tokens = jnp.asarray(np.random.default_rng(0).integers(5, 100, size=(2, 8)), jnp.int32)
    nothing = jnp.zeros((2, 8), bool)
    value, metrics = loss(model.module(), tokens, nothing, jax.random.key(0), 4, 2)
    assert float(value) == 0.0 and int(metrics["masked_tokens"]) == 0
    everything = jnp.ones((2, 8), bool)
    value, metrics = loss(model.module(), tokens, everything, jax.random.key(0), 4, 2)
    assert float(value) > 0 and int(metrics["masked_tokens"]) > 0


def test_batched_pair_encoding_equals_one_prompt_at_a_time():
    model = tiny_model(tokenizer=True, block_size=8)
    examples = tasks.held_out(3)
    pairs = encode_pairs(model.tokenizer, [e.question for e in examples], [e.answer for e in examples], 160)
    eos = model.tokenizer.eos_token_id
    for example, (ids, start) in zip(examples, pairs, strict=True):
        prompt = encode_prompt(model, example.question)
        response = model.tokenizer.encode(example.answer, add_special_tokens=False)
        assert start == len(prompt) and ids[:start] == prompt
        assert ids[start:start + len(response)] == response
        assert ids[start + len(response):] == [eos] * (160 - start - len(response))
    # A pair that does not fit is None, not cut.
    assert encode_pairs(model.tokenizer, ["Copy: a b c"], ["a b c"], 4) == [None]


def test_held_out_questions_never_appear_in_training_batches():
    model = tiny_model(tokenizer=True, block_size=8)
    source = TaskSource(model, batch_size=16, length=120)
    held = {ex.question for ex in tasks.held_out(20)}
    seen = {source.example(i).question for i in range(2000)}
    assert held and not (held & seen)
    tokens, trainable = source.batch(3)
    again, _ = source.batch(3)
    np.testing.assert_array_equal(tokens, again)  # a batch is a function of its index
    assert trainable.any(axis=1).all() and not trainable.all(axis=1).any()


def test_batches_of_one_task_are_trimmed_to_the_block_multiple_they_need():
    model = tiny_model(tokenizer=True, block_size=8)
    names = ("copy", "add")
    full = TaskSource(model, batch_size=8, length=120, task_names=names)
    trimmed = TaskSource(model, batch_size=8, length=120, task_names=names, trim_multiple=8)
    eos = model.tokenizer.eos_token_id
    for index in range(4):
        tokens, trainable = trimmed.batch(index)
        task = names[index % 2]
        assert {trimmed.example(i, task).task for i in range(index * 8, index * 8 + 8)} == {task}
        assert tokens.shape[1] % 8 == 0 and tokens.shape[1] < 120
        # Nothing but EOS padding is cut, and every pair keeps its own EOS.
        examples = [trimmed.example(i, task) for i in range(index * 8, index * 8 + 8)]
        reference = encode_pairs(model.tokenizer, [e.question for e in examples],
                                 [e.answer for e in examples], 120)
        for row, (ids, start) in zip(tokens, reference, strict=True):
            assert row.tolist() == ids[:tokens.shape[1]]
            assert all(t == eos for t in ids[tokens.shape[1]:])
            assert eos in row[start:].tolist()
        assert trainable.shape == tokens.shape
    assert full.batch(0)[0].shape == (8, 120)


def params_of(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(model.params))


def test_ctrl_c_saves_a_checkpoint_and_the_rerun_ends_with_the_uninterrupted_weights(
        tmp_path, monkeypatch):
    import json
    import os
    import signal

    model = tiny_model(tokenizer=True, block_size=8)
    source = TaskSource(model, batch_size=4, length=120)
    cfg = TrainConfig(steps=4, warmup_steps=1, block_size=8, log_every=1, checkpoint_seconds=None,
                      compute_dtype="float32", truncate_prob=0.5, stale_prob=0.5)
    straight = train(model, source, cfg, tmp_path / "a", progress=False)
    batch = source.batch

    def interrupted_batch(index):
        if index == 2:  # Ctrl-C while the third step is being prepared
            os.kill(os.getpid(), signal.SIGINT)
        return batch(index)

    monkeypatch.setattr(source, "batch", interrupted_batch)
    with pytest.raises(KeyboardInterrupt, match="interrupted at step 3 of 4"):
        train(model, source, cfg, tmp_path / "b", progress=False)
    assert not (tmp_path / "b" / "model").exists()
    monkeypatch.setattr(source, "batch", batch)
    resumed = train(model, source, cfg, tmp_path / "b", progress=False)
    for a, b in zip(jax.tree.leaves(params_of(straight)), jax.tree.leaves(params_of(resumed)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [record["step"] for record in log] == [1, 2, 3, 4]
    assert (tmp_path / "a" / "model" / "params").is_dir()
    assert not np.allclose(jax.tree.leaves(params_of(model))[0],
                           jax.tree.leaves(params_of(straight))[0])


@pytest.mark.parametrize(("every", "seconds", "saved"), [
    (2, None, [2, 4, 5]),    # every 2 steps, and the last
    (None, 1e-9, [1, 2, 3, 4, 5]),  # by time: each step takes longer than a nanosecond
    (None, 1e9, [5]),        # neither comes due: the end alone
])
def test_checkpoints_are_saved_every_n_steps_by_time_and_at_the_end(tmp_path, monkeypatch, every,
                                                                    seconds, saved):
    import orbax.checkpoint as ocp

    model = tiny_model(tokenizer=True, block_size=8)
    source = TaskSource(model, batch_size=2, length=48, task_names=("copy",))
    steps = []
    save = ocp.CheckpointManager.save
    monkeypatch.setattr(ocp.CheckpointManager, "save",
                        lambda self, step, *a, **k: steps.append(step) or save(self, step, *a, **k))
    cfg = TrainConfig(steps=5, warmup_steps=1, block_size=8, compute_dtype="float32",
                      checkpoint_every=every, checkpoint_seconds=seconds)
    train(model, source, cfg, tmp_path / "run", progress=False)
    assert steps == saved


def test_fine_tuning_on_user_pairs_lowers_the_loss(tmp_path):
    import json

    from focus_jax.train import PairSource
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"say {w}", "response": w})
                              for w in ["hi", "yo", "ok", "no"]) + "\n")
    model = tiny_model(tokenizer=True, block_size=8)
    source = PairSource(model, data, batch_size=4, length=24)
    cfg = TrainConfig(steps=30, warmup_steps=2, learning_rate=3e-3, block_size=8, log_every=1,
                      compute_dtype="float32")
    train(model, source, cfg, tmp_path / "run", progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    first, last = np.mean([r["loss"] for r in log[:5]]), np.mean([r["loss"] for r in log[-5:]])
    assert last < first


def test_bad_pair_file_is_a_clear_error(tmp_path):
    from focus_jax.train import PairSource
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="'prompt' and 'response'"):
        PairSource(tiny_model(tokenizer=True), bad, batch_size=2, length=16)


def test_prefetched_batches_equal_the_source_in_any_order():
    from focus_jax.train import Prefetch
    model = tiny_model(tokenizer=True, block_size=8)
    source = TaskSource(model, batch_size=4, length=120, task_names=("copy", "add"),
                        trim_multiple=8)
    with Prefetch(source, workers=2, depth=3) as ahead:
        # In order, then a jump back (a resumed run) and a jump forward past the window.
        for index in [0, 1, 2, 3, 1, 9]:
            tokens, trainable = ahead.batch(index)
            expected_tokens, expected_trainable = source.batch(index)
            np.testing.assert_array_equal(tokens, expected_tokens)
            np.testing.assert_array_equal(trainable, expected_trainable)
    with pytest.raises(ValueError, match="workers"):
        Prefetch(source, workers=0)


def test_embedding_gradient_is_the_one_hot_gradient_summed_in_float32():
    from focus_jax.models.layers import embedding_lookup
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(7, 5)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 7, size=(3, 11)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(3, 11, 5)), jnp.float32)
    np.testing.assert_array_equal(embedding_lookup(table, tokens), table[tokens])
    ours = jax.grad(lambda t: (embedding_lookup(t, tokens) * weights).sum())(table)
    one_hot = jax.grad(lambda t: ((jax.nn.one_hot(tokens, 7) @ t) * weights).sum())(table)
    np.testing.assert_allclose(ours, one_hot, rtol=1e-5, atol=1e-5)
    # 1,000 unit gradients into one bfloat16 row: a bfloat16 running sum stops at 256.
    table16 = jnp.zeros((4, 3), jnp.bfloat16)
    same = jnp.zeros((1000,), jnp.int32)
    grad16 = jax.grad(lambda t: embedding_lookup(t, same).astype(jnp.float32).sum())(table16)
    assert grad16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(grad16, np.float32),
                                  [[1000.0] * 3, [0.0] * 3, [0.0] * 3, [0.0] * 3])
