"""Sharded decoding equals single-device decoding (8 forced CPU devices, in a subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from focus_jax import ConfigError, GenerationConfig, generate
from focus_jax.sharding import check_divisible, make_mesh, parse_mesh
from focus_jax.testing import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def test_sharded_generate_equals_single_device_in_every_mode_and_mesh():
    # Every program rounds where the code says (compare.py's docstring says why).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8",
                                        "--xla_allow_excess_precision=false")}
    out = subprocess.run([sys.executable, str(ROOT / "tests/sharding/compare.py"), "baseline",
                          "delayed", "focus"], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    collectives = [r.pop("collectives") for r in rows if "collectives" in r]
    # The bundled bfloat16 model on a data=2 mesh, where FOCUS turns any difference of one
    # rounding in layers 0-1 into other tokens.
    assert [r.pop("bundled_focus_equal") for r in rows if "bundled_focus_equal" in r] == [True]
    # The server's round interrupts (a host callback in the round's loop) on a 2x4 mesh.
    assert [r.pop("interrupted") for r in rows if "interrupted" in r] == [
        {"steps": [1, 1, 1], "equal": True}]
    # Experts split over an expert axis (with data and model axes): the same tokens, and each
    # device holds [sparse layers, experts / expert, E, 2, width / model] of the experts.
    experts = [r.pop("experts") for r in rows if "experts" in r]
    assert len(experts) == 1 and len(experts[0]) == 4, experts
    assert {(tuple(r["mesh"]), r["weights"]) for r in experts[0]} == {
        ((2, 4, 1), "float32"), ((1, 4, 2), "float32"), ((2, 2, 2), "float32"),
        ((2, 2, 2), "int8")}
    for row in experts[0]:
        data, expert, model = row["mesh"]
        assert row["equal"], row
        assert row["gate_up_shard_shape"] == [3, 16 // expert, 64, 2, 32 // model], row
    # A paged KV cache on a model=4 mesh: the pool's KV heads split four ways; with data=2 too,
    # each data shard holds half the pages (those of its own slots).
    [paged] = [r.pop("paged") for r in rows if "paged" in r]
    assert [(r["data"], r["equal"], r["pool_shard_shape"]) for r in paged] == [
        (1, True, [4, 20, 4, 2, 8]), (2, True, [4, 10, 4, 2, 8])]
    assert all(r["prefix_hit_tokens"] > 0 for r in paged), paged  # cached prefixes were read
    rows = [r for r in rows if r]
    # Data parallel: no activations cross devices inside the step (before each shard stepped
    # its own slots, a data=2 round of the tiny model held 75 all-reduces and 22 all-gathers);
    # what is left is the largest bucket of any shard, reported to the host.
    assert collectives and collectives[0].get("all-gather", 0) == 0, collectives
    assert sum(collectives[0].values()) <= 4, collectives
    # FOCUS on every mesh (all data, all model, both); the other modes, whose steps are parts
    # of FOCUS's, on the mesh of both axes.
    assert {(r["mode"], tuple(r["mesh"])) for r in rows} == {
        ("focus", mesh) for mesh in ((8, 1), (1, 8), (2, 4))} | {
        (mode, (2, 4)) for mode in ("baseline", "delayed")} | {("focus-sampled", (8, 1))}
    for row in rows:
        data, model = row["mesh"]
        assert row["equal"], row
        assert row["cache_shards"] == 8
        # [layers, slots / data, positions, kv_heads / model, head_dim]; MLP columns / model.
        assert row["cache_shard_shape"][1] == 8 // data
        assert row["cache_shard_shape"][3] == 8 // model
        assert row["gate_shard_shape"][3] == 128 // model


def test_mesh_spec_parsing_and_errors():
    assert parse_mesh("data=2,model=4") == {"data": 2, "expert": 1, "model": 4}
    assert parse_mesh("model=2") == {"data": 1, "expert": 1, "model": 2}
    assert parse_mesh("data=2,expert=4") == {"data": 2, "expert": 4, "model": 1}
    with pytest.raises(ConfigError, match="bad mesh"):
        parse_mesh("data=two")
    with pytest.raises(ConfigError, match="needs 4 devices"):
        make_mesh(2, 2)


def test_dimension_that_does_not_divide_is_a_clear_error(model):
    with pytest.raises(ConfigError, match="do not divide by the mesh's data axis"):
        check_divisible(model.config, {"data": 3, "model": 1}, slots=4)
    with pytest.raises(ConfigError, match="num_attention_heads = 4 does not divide"):
        check_divisible(model.config, {"data": 1, "model": 3})
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        check_divisible(model.config, {"data": 1, "expert": 2, "model": 1})


def test_expert_axis_errors_name_the_field():
    from focus_jax.models import geometry

    mini = geometry("llada2-mini")  # 256 experts of width 512
    check_divisible(mini, {"data": 2, "expert": 8, "model": 1})
    with pytest.raises(ConfigError, match="num_experts = 256 does not divide by the mesh's expert"):
        check_divisible(mini, {"data": 1, "expert": 3, "model": 1})
    with pytest.raises(ConfigError, match="moe_intermediate_size = 512 does not divide"):
        check_divisible(mini.replace(num_heads=12, num_kv_heads=3, vocab_size=157182,
                                     intermediate_size=5121),
                        {"data": 1, "expert": 1, "model": 3})
    check_divisible(mini, {"data": 2, "expert": 2, "model": 2})  # all three axes at once


def test_a_one_device_mesh_decodes_like_no_mesh(model):
    # Two buckets (a compaction switch on the mesh): half the round's branches of the CPU's four.
    config = GenerationConfig(block_size=4, max_new_tokens=4, threshold=0.04,
                              bucket_ladder=(0.5, 1.0))
    plain = generate(model, [[5, 6], [7, 8, 9]], config)
    meshed = generate(model, [[5, 6], [7, 8, 9]], config, mesh=make_mesh(1, 1))
    assert [r.token_ids for r in meshed] == [r.token_ids for r in plain]


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_on_localhost_decode_like_one():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    script = str(ROOT / "tests/sharding/multiprocess.py")
    port = str(_free_port())
    workers = [subprocess.Popen([sys.executable, script, port, str(i), "focus"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in (0, 1)]
    # The unsharded tokens, here (the same XLA options and matmul precision as the workers')
    # while the two processes start.
    from tests.sharding.multiprocess import decode

    single = decode("focus")
    outputs = [w.communicate(timeout=600) for w in workers]
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:]
    lines = lambda text: [json.loads(x) for x in text.splitlines() if x.startswith("[[")]
    assert lines(outputs[1][0]) == []  # only process 0 prints
    assert lines(outputs[0][0]) == [single] and single != []


def test_a_hugging_face_folder_loads_straight_into_the_shards(tmp_path):
    """The reader of host tensors places each one with its parameter's sharding (no device is
    given a whole tensor it does not own, then resharded): the weights equal the single-device
    load, through ``load_safetensors`` and through ``focus_jax.load`` (which restores a converted
    folder into the shards too)."""
    from flax import nnx

    import focus_jax
    from focus_jax.models.weights import save_safetensors
    from focus_jax.testing import tiny_model

    model = tiny_model(num_heads=8, num_kv_heads=8, vocab_size=256)
    hf = tmp_path / "hf"
    save_safetensors(nnx.merge(model.graphdef, model.params), hf)
    (hf / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    converted = focus_jax.save(model, tmp_path / "converted")
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"),
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(ROOT / "tests/sharding/load.py"), str(hf),
                          str(converted)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    loads = [row for row in rows if "load" in row]
    rows = [row for row in rows if "load" not in row]
    assert len(loads) == 3 * 2 and all(row["load"] for row in loads), loads
    assert len(rows) == 3 * len(nnx.to_flat_state(model.params))
    for row in rows:
        assert row["equal"] and row["sharding"], row
        if row["sharded"]:
            # One shard shape, smaller than the whole tensor: no device got all of it.
            [shard] = row["shard_shapes"]
            assert shard != row["shape"], row
    # Heads, MLP and vocabulary split over model; nothing splits over data alone.
    assert {tuple(r["mesh"]) for r in rows if r["sharded"]} == {(2, 4), (1, 8)}
