"""TPU programs compiled on this CPU machine (libtpu's compilers, no TPU), and ``compile-check``.

Shapes are tiny and the ladders short: a compile of the tiny model's decode round takes seconds
on two cores, where a 16-bucket ladder of a real geometry takes minutes.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from focus_jax import GenerationConfig, compile_check, tpu
from focus_jax.cli import main
from focus_jax.config import ConfigError
from focus_jax.testing import tiny_config

needs_libtpu = pytest.mark.skipif(not tpu.libtpu_installed(),
                                  reason="libtpu is not installed (pip install 'focus-jax[tpu]')")

# Eight query and four KV heads, so that a model axis of 4 splits them; bfloat16 as served.
TINY = tiny_config(num_heads=8, num_kv_heads=4, dtype="bfloat16", block_size=8)
SHORT_LADDER = (0.5, 1.0)


def round_target(mode: str, topology: str, mesh: str | None, kernels: str, **generation):
    """The tiny decode round's target on ``topology``."""
    return compile_check.make_target(
        TINY, topology, slots=16, positions=64, mesh=mesh, prompt_lengths=(),
        generation=GenerationConfig(mode=mode, kernels=kernels, bucket_ladder=SHORT_LADDER,
                                    **generation))


@functools.cache
def decode_round(mode: str, topology: str, mesh: str | None, kernels: str, **generation):
    """The report of the tiny decode round compiled for ``topology`` (each compiled once per
    session: the tests below read the same reports)."""
    [report] = compile_check.check(round_target(mode, topology, mesh, kernels, **generation))
    return report


@needs_libtpu
@pytest.mark.parametrize("mode", ["baseline", "focus"])
def test_tiny_decode_round_with_tpu_kernels_compiles_for_one_v5e_chip_and_a_2x4_mesh(mode):
    one = decode_round(mode, "v5e:1x1", None, "pallas_tpu")
    eight = decode_round(mode, "v5e:2x4", "data=2,model=4", "pallas_tpu")
    for report in (one, eight):
        assert report.result.compiled, report.result.error
        assert report.fits and report.flops > 0
    # Slots over data and heads over model: each chip of the mesh holds a fraction of the
    # weights and the cache that one chip holds alone.
    assert eight.result.memory.arguments < one.result.memory.arguments / 2


@needs_libtpu
def test_a_mixture_of_experts_round_compiles_for_one_v5e_chip_and_an_expert_mesh():
    """LLaDA2-style experts (tokamax's GMM v2 kernel on TPUs) on one chip, and split over an
    expert axis of 2 with data=2 and model=2 on a v5e 2x4 slice (all three axes at once)."""
    from focus_jax.config import MoEConfig

    moe = MoEConfig(num_experts=16, experts_per_token=4, expert_size=64, dense_layers=(0,),
                    scores="sigmoid", num_groups=4, groups_per_token=2, expert_bias=True,
                    shared_expert_size=64)
    cfg = TINY.replace(model_type="llada2_moe", moe=moe, partial_rotary_factor=0.5)
    reports = []
    for topology, mesh in (("v5e:1x1", None), ("v5e:2x4", "data=2,expert=2,model=2")):
        target = compile_check.make_target(
            cfg, topology, slots=16, positions=64, mesh=mesh, prompt_lengths=(),
            generation=GenerationConfig(mode="focus", kernels="pallas_tpu",
                                        bucket_ladder=SHORT_LADDER))
        [report] = compile_check.check(target)
        assert report.result.compiled, report.result.error
        reports.append(report)
    one, eight = reports
    # Each chip of the mesh holds half the experts at half their width.
    assert eight.result.memory.arguments < one.result.memory.arguments


@needs_libtpu
def test_a_paged_round_compiles_for_a_v5e_chip_and_holds_only_its_pool():
    """The paged KV cache's decode round with the paged Mosaic kernel: 40 pages of 8 positions
    where the contiguous cache reserves 16 slots x 64 positions (128 pages' worth)."""
    paged = decode_round("focus", "v5e:1x1", None, "pallas_tpu", kv_cache="paged", kv_pages=40)
    contiguous = decode_round("focus", "v5e:1x1", None, "pallas_tpu")
    assert paged.result.compiled, paged.result.error
    page = 2 * TINY.num_layers * 8 * TINY.num_kv_heads * TINY.head_dim * 2  # K and V, bfloat16
    table = 16 * 8 * 4  # 8 int32 entries per slot
    assert contiguous.resident_bytes - paged.resident_bytes == (128 - 40) * page - table
    assert paged.result.memory.arguments < contiguous.result.memory.arguments
    # On a data=2, model=4 mesh of a v5e 2x4 slice each chip holds its data shard's half of the
    # pages, a quarter of their KV heads: 40 more pages are 40 / 8 pages' bytes more per chip.
    # (The report's resident bytes are compile_check.resident's, which needs no compile: the
    # larger pool is not compiled again.)
    small = decode_round("focus", "v5e:2x4", "data=2,model=4", "pallas_tpu", kv_cache="paged",
                         kv_pages=40)
    assert small.result.compiled, small.result.error
    large = compile_check.resident(round_target("focus", "v5e:2x4", "data=2,model=4",
                                                "pallas_tpu", kv_cache="paged", kv_pages=80))
    assert large.total - small.resident_bytes == 40 * page // 8


@needs_libtpu
def test_the_servers_interruptible_round_compiles_for_a_v5e_chip():
    """``focus-jax serve`` runs interruptible rounds: a host callback in the round's loop."""
    report = decode_round("focus", "v5e:1x1", None, "pallas_tpu", interruptible_rounds=True)
    assert report.result.compiled, report.result.error


@needs_libtpu
def test_a_prompt_longer_than_a_chunk_compiles_as_chunks_for_a_v5e_chip():
    """A prompt longer than the engine's prefill chunk (1,024 tokens) is prefilled in chunks,
    each a prefill after a cached prefix: those compile, and no whole prefill of its length."""
    target = compile_check.make_target(TINY, "v5e:1x1", slots=2, positions=1100,
                                       prompt_lengths=(1100,), generation=GenerationConfig())
    reports = list(compile_check.check(target, decode=False))
    assert [r.name for r in reports] == ["prefill chunk 1x96", "prefill chunk 1x1024"]
    assert all(r.result.compiled and r.fits for r in reports), [r.result.error for r in reports]


@needs_libtpu
def test_prefill_counts_the_weights_it_does_not_read():
    """jit drops the arguments a program does not read (prefill: the LM head), but they stay in
    HBM: a program's total counts every resident byte. (A vocabulary large enough that the LM
    head outweighs what the TPU's tiled layouts add to tiny arrays.)"""
    cfg = tiny_config(vocab_size=8192, dtype="bfloat16", block_size=8)
    target = compile_check.make_target(cfg, "v5e:1x1", slots=4, positions=32,
                                       prompt_lengths=(8,), generation=GenerationConfig())
    alone, prefill = compile_check.check(target, decode=False)  # 1 row, then the 4-row batch
    assert (alone.name, prefill.name) == ("prefill 1x8", "prefill 4x8")
    resident = compile_check.resident(target)
    assert prefill.result.memory.arguments < resident.total
    memory = prefill.result.memory
    assert prefill.needed >= resident.total + memory.temporaries + memory.code


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    return folder


def compile_check_cli(folder, *options: str) -> list[str]:
    return ["compile-check", "--model", str(folder), "--batch", "4", "--max-len", "32",
            "--bucket-ladder", "1", *options]


@needs_libtpu
def test_compile_check_prints_every_program_and_succeeds(tiny_folder, capsys):
    code = main(compile_check_cli(tiny_folder, "--topology", "v5e:1x1", "--prompt-buckets", "5,9"))
    out = capsys.readouterr().out
    assert code == 0, out
    # Prefill at the buckets holding prompts of 5 and 9 tokens (8 and 16), a request alone and
    # a batch of 4, then the round.
    rows = [line.split()[0:3] for line in out.splitlines() if "compiled" in line.split()[2:3]]
    assert rows == [["prefill", f"{n}x{length}", "compiled"] for n in (1, 4) for length in (8, 16)
                    ] + [["decode", "round", "compiled"]], out
    assert "all 5 programs compiled and fit" in out
    assert "weights + decode state per chip" in out


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_int8_weights_and_activations_compile_for_a_v5e_and_a_v6e_chip(tiny_folder, capsys,
                                                                        topology):
    """The issue's TPU path: int8 weights, and int8 activations (the v5e's fast int8 MXU) in
    the round's full bucket; FP8 activations are refused before any compile."""
    code = main(compile_check_cli(tiny_folder, "--topology", topology, "--prompt-buckets", "none",
                                  "--quantize", "int8", "--quantize-activations-from", "32"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "int8 projections and experts (int8 activations from 32 rows)" in out
    assert "all 1 programs compiled and fit" in out
    assert main(compile_check_cli(tiny_folder, "--topology", topology, "--prompt-buckets", "none",
                                  "--quantize", "fp8", "--quantize-activations-from", "32")) == 2
    assert "TPUs before v7 lack" in capsys.readouterr().err


@needs_libtpu
def test_compile_check_fails_when_a_program_does_not_fit_the_chip(tiny_folder, capsys):
    code = main(compile_check_cli(tiny_folder, "--topology", "v6e:2x2", "--mesh", "data=2",
                                  "--prompt-buckets", "none", "--hbm-gib", "0.0001"))
    out = capsys.readouterr().out
    assert code == 1
    assert "too big" in out and "1 do not fit" in out


def test_compile_check_without_libtpu_says_how_to_install_it(tiny_folder, capsys, monkeypatch):
    monkeypatch.setattr(tpu, "libtpu_installed", lambda: False)
    code = main(compile_check_cli(tiny_folder, "--topology", "v5e:1x1"))
    err = capsys.readouterr().err
    assert code == 2
    assert "pip install 'focus-jax[tpu]'" in err and "Traceback" not in err


@pytest.mark.parametrize("options, message", [
    (["--topology", "v9x:2x2"], "unknown TPU generation 'v9x'"),
    (["--topology", "v5p:2x2"], "a v5p shape has 3 positive dimensions"),
    (["--topology", "v5e:2x4"], "give --mesh data=D,model=M"),
    (["--topology", "v5e:2x2", "--mesh", "data=4,model=2"], "needs 8 chips, v5e:2x2 has 4"),
    (["--topology", "v5e:2x4", "--mesh", "data=8"], "4 slots do not divide by the mesh's data"),
    (["--topology", "v5e:2x4", "--mesh", "model=8"], "num_key_value_heads = 4 does not divide"),
    (["--topology", "v5e:1x1", "--prompt-buckets", "40"], "prompt lengths [40] do not fit"),
    (["--topology", "v5e:1x1", "--geometry", "sdar-8b"], "one of --geometry NAME or --model"),
])
def test_bad_options_are_one_line_errors_before_any_compile(tiny_folder, capsys, monkeypatch,
                                                            options, message):
    def no_compile(*_args):
        raise AssertionError("compiled before checking the options")

    monkeypatch.setattr(compile_check, "check", no_compile)
    monkeypatch.setattr(tpu, "devices", no_compile)
    code = main(compile_check_cli(tiny_folder, *options))
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("slots", [64, 8])
def test_model_flops_of_a_step_match_what_xla_counts(slots):
    """The FLOPs from shapes count the work the compiled step does (XLA's own count, on the CPU
    with the XLA kernels and the layers unrolled; a geometry where matmuls dominate: the rest is
    elementwise work the model FLOPs leave out). With 8 slots the 64-row bucket is smaller than
    an LM-head chunk (decoding.HEAD_CHUNK, 512 rows): the head runs those rows alone, unpadded."""
    import dataclasses

    import jax

    from focus_jax import decoding
    from focus_jax.testing import tiny_model

    model = tiny_model(num_layers=3, hidden_size=256, intermediate_size=1024, num_heads=4,
                       num_kv_heads=2, head_dim=64, vocab_size=512, block_size=8)
    positions = 32
    rows = slots * 8
    target = compile_check.make_target(model.config, "v5e:1x1", slots=slots, positions=positions,
                                       generation=GenerationConfig(mode="focus", kernels="xla"))
    settings = dataclasses.replace(compile_check.settings(target, None), processed_ladder=(rows,),
                                   retained_ladder=(rows,), unroll_layers=True)
    state = jax.eval_shape(lambda: decoding.init_state(model.config, slots, positions, 8, 0))
    counted = jax.jit(lambda s: decoding.step(model.module(), s, settings)).lower(state).compile()
    ours = compile_check.decode_step_flops(model.config, settings, slots, rows, rows, positions)
    assert ours == pytest.approx(counted.cost_analysis()["flops"], rel=0.02)


@pytest.mark.parametrize("slots, positions, prefill_batch", [(12, 30, None), (3, 64, None),
                                                            (12, 30, 5), (2, 1100, None)])
def test_the_target_has_the_engines_cache_prefill_batch_and_buckets(slots, positions,
                                                                    prefill_batch):
    from focus_jax import Engine
    from focus_jax.engine.runner import default_prefill_batch
    from focus_jax.testing import tiny_model

    model = tiny_model(block_size=8)
    config = GenerationConfig()
    engine = Engine(model, config, slots=slots, cache_len=positions,
                    prefill_batch=prefill_batch)
    target = compile_check.make_target(model.config, "v5e:1x1", slots=slots,
                                       positions=positions, generation=config,
                                       prefill_batch=prefill_batch)
    assert target.positions == engine.cache_len
    # The engine here runs on a CPU, whose default prefill batch is 1; on a TPU it takes the
    # accelerators' default, the target's.
    assert target.prefill_batch == (prefill_batch or default_prefill_batch(slots, "tpu"))
    assert engine.runner.prefill_batch == (prefill_batch or default_prefill_batch(slots, "cpu"))
    padding, after_prefix = engine.runner._warmup_inputs(None, prefix=False)
    assert target.prompt_buckets == tuple(sorted({args[0].shape[1] for args in padding}))
    assert target.chunk_buckets == tuple(static["computed"] for _, static in after_prefix)


def test_the_smallest_step_is_every_data_shard_at_its_own_smallest_bucket():
    """Each data shard compacts its own slots: data=2 over 16 slots steps like two data=1
    targets of 8 (model FLOPs are linear in slots and rows)."""
    def smallest(topology, mesh, slots):
        target = compile_check.make_target(TINY, topology, slots=slots, positions=64, mesh=mesh,
                                           generation=GenerationConfig())
        return compile_check.decode_flops_range(target)[1]

    assert smallest("v5e:2x4", "data=2,model=4", 16) == 2 * smallest("v5e:1x1", None, 8)


def test_the_description_names_the_tpus_default_ladder_when_none_is_given():
    from focus_jax.config import DEFAULT_LADDER

    target = compile_check.make_target(TINY, "v5e:1x1", slots=4, positions=32,
                                       generation=GenerationConfig())
    assert f"{len(DEFAULT_LADDER)}-bucket ladder" in compile_check.describe(target)


def test_one_chip_is_named_as_a_1x1_topology_of_its_generation():
    one = tpu.parse_topology("v5e:1x1")
    assert one.chips == 1 and one.chip.host_topology == "v5e:2x2"
    assert tpu.parse_topology("v5p:2x2x2").chips == 8
    with pytest.raises(ConfigError, match="expected GENERATION:SHAPE"):
        tpu.parse_topology("v5litepod-8")


# With the persistent cache on in a fresh folder: a CPU program, compile-check's programs (a
# prefill and a decode round), then another CPU program; prints the programs kept there.
CHECK_WITH_THE_CACHE_ON = """
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from focus_jax import GenerationConfig, compilation, compile_check
from focus_jax.testing import tiny_config

folder = Path(sys.argv[1])
compilation.use_persistent_cache(folder)
jax.jit(lambda x: x + 1)(jnp.ones(3))
target = compile_check.make_target(tiny_config(dtype="bfloat16", block_size=8), "v5e:1x1",
                                   slots=4, positions=32, prompt_lengths=(8,),
                                   generation=GenerationConfig(bucket_ladder=(1.0,)))
assert all(report.fits for report in compile_check.check(target))
jax.jit(lambda x: x * 3)(jnp.ones(3))
print(" ".join(p.name.split("-")[0] for p in folder.iterdir() if p.name.endswith("-cache")))
"""


@needs_libtpu
def test_tpu_programs_are_not_written_to_the_persistent_cache(tmp_path):
    """A program compiled for a TPU topology cannot be loaded back (the compile-only client has
    no runtime: "PjRtCompiler must be constructed with a Client"), so none is written; the
    process's other programs still are."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", CHECK_WITH_THE_CACHE_ON, str(tmp_path / "xla")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    kept = done.stdout.split()
    assert kept.count("jit__lambda") == 2, kept
    assert "jit_prefill" not in kept and "jit_decode_round" not in kept, kept


@needs_libtpu
def test_the_compile_check_command_prints_its_table_and_nothing_else_and_leaves_the_cache_alone(
        tiny_folder, tmp_path):
    """Run as a user runs it (JAX_PLATFORMS unset), twice with the same cache folder: nothing
    is written there, so the second run warns of no entry it cannot load; and libtpu, loaded
    for the topology (a v5e host of 2x2 chips, a mesh of one), prints nothing either (it once
    printed its metadata warnings and an "E0000 ... INVALID_ARGUMENT" line in the middle of the
    table; tests/libtpu_quiet.py says where the other commands are checked)."""
    from tests.libtpu_quiet import tpu_chips

    folder = tmp_path / "xla"
    env = {**{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"},
           "FOCUS_JAX_CACHE_DIR": str(folder)}
    command = [sys.executable, "-m", "focus_jax.cli",
               *compile_check_cli(tiny_folder, "--topology", "v5e:2x2", "--mesh",
                                  "data=1,model=1", "--prompt-buckets", "8")]
    for _ in range(2):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stdout + done.stderr
        assert "all 3 programs compiled and fit" in done.stdout  # prefill 1x8 and 4x8, the round
        assert "decode round       compiled" in done.stdout
        assert "PjRtCompiler" not in done.stderr and "persistent compilation cache" not in \
            done.stderr, done.stderr
        if not tpu_chips():  # a host without TPU chips, as CI's
            assert done.stderr == ""
    assert not folder.exists() or not any(folder.iterdir())
