"""8-bit weights (docs/quantization.md): the quantized forward against float32, the FP8 products
of 8-bit activations, quantized checkpoints, zero compiles while serving, clear errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import focus_jax
from focus_jax import ConfigError, bench, quant
from focus_jax.cli import main
from focus_jax.config import Quantization
from focus_jax.model import Model, _logits
from focus_jax.models.matmul import QTYPES
from focus_jax.testing import xla_flags
from tests.test_moe_decoding import llada2_model, serves_without_compiling

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
DENSE, MOE = FIXTURES / "qwen3_untied", FIXTURES / "sdar_moe_tiny"
TOLERANCE = {"int8": 0.05, "fp8": 0.2}
"""Largest relative RMS error of the logits against float32 (transformers' own) on the random
tiny parity checkpoints: int8 rounds each weight to 1/127 of its channel's largest, FP8 e4m3 to
3 mantissa bits (up to 1/16 of the weight itself), and the errors compound over the layers.
Measured: int8 0.022-0.035, FP8 0.077-0.106 on the four parity checkpoints."""


def reference(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """The fixture's tokens and transformers' float32 logits at block size 4."""
    saved = np.load(folder / "reference_logits.npz")
    return saved["tokens"], saved["logits_b4"]


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def dequantized(model: Model, plain: Model) -> Model:
    """``plain`` with every weight that ``model`` quantized replaced by its dequantized value."""
    quantized = dict(nnx.to_flat_state(model.params))
    _, state = nnx.split(nnx.clone(plain.module()))
    for path, var in nnx.to_flat_state(state):
        if (*path, "qvalue") in quantized:
            q = qwix.QArray(quantized[(*path, "qvalue")].get_value(),
                            quantized[(*path, "scale")].get_value(),
                            qtype=quantized[(*path, "qvalue")].get_value().dtype)
            var.set_value(qwix.dequantize(q))
    return Model(plain.config, plain.graphdef, state)


@pytest.mark.parametrize("folder", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_quantized_forward_is_the_dequantized_weights_forward_close_to_float32(folder, weights):
    tokens, want = reference(folder)
    plain = focus_jax.load(folder, dtype="float32", tokenizer=False)
    model = focus_jax.load(folder, dtype="float32", tokenizer=False, quantize=weights)
    stored = {var.get_value().dtype for _, var in nnx.to_flat_state(model.params)}
    assert jnp.dtype(QTYPES[weights]) in stored
    got = np.asarray(model.logits(tokens, 4))
    # Weights only: exactly the product with the dequantized weights (the matmul's own error).
    np.testing.assert_allclose(got, np.asarray(dequantized(model, plain).logits(tokens, 4)),
                               rtol=1e-5, atol=1e-5)
    assert relative_error(got, want) < TOLERANCE[weights]
    assert relative_error(np.asarray(plain.logits(tokens, 4)), want) < 1e-5


def fp8_products(model: Model, tokens: np.ndarray) -> int:
    """How many dot products of the uncached forward take two FP8 operands."""
    text = _logits.lower(model.graphdef, model.params, jnp.asarray(tokens), 4).as_text()
    dots = [line.split("->")[0] for line in text.splitlines() if "stablehlo.dot_general" in line]
    return sum(line.count("f8E4M3FN") == 2 for line in dots)


def test_fp8_activations_make_fp8_products_from_their_row_threshold():
    tokens, want = reference(DENSE)
    plain = focus_jax.load(DENSE, dtype="float32", tokenizer=False)
    rows = tokens.size  # the projections' rows: every token of the batch
    at = quant.quantize(plain, Quantization("fp8", activations_from=rows))
    above = quant.quantize(plain, Quantization("fp8", activations_from=rows + 1))
    assert fp8_products(at, tokens) == 4  # q/k/v, output, gate/up and down: one layer body
    assert fp8_products(above, tokens) == 0
    assert relative_error(np.asarray(at.logits(tokens, 4)), want) < TOLERANCE["fp8"]


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_a_quantized_checkpoint_restores_the_same_weights(weights, tmp_path):
    loaded = focus_jax.load(DENSE, dtype="float32", tokenizer=False, quantize=weights)
    out = focus_jax.convert(DENSE, tmp_path / "converted", dtype="float32", quantize=weights)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "focus_jax", "weights": weights}
    restored = focus_jax.load(out, tokenizer=False)
    assert restored.config.quantization == Quantization(weights)
    want = dict(nnx.to_flat_state(loaded.params))
    for path, var in nnx.to_flat_state(restored.params):
        np.testing.assert_array_equal(np.asarray(var.get_value()),
                                      np.asarray(want[path].get_value()))
        assert var.get_value().dtype == want[path].get_value().dtype
    tokens, _ = reference(DENSE)
    np.testing.assert_array_equal(np.asarray(restored.logits(tokens, 4)),
                                  np.asarray(loaded.logits(tokens, 4)))


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_a_bfloat16_model_with_8_bit_weights_decodes_on_the_cpu(weights):
    """The served dtype, dense and experts: XLA's CPU runtime has no bf16 x bf16 -> f32 GEMM, so
    the weights-only product (bf16 activations, 8-bit values, float32 accumulation) failed
    ("Unsupported element type for DotThunk::Execute") in the dense model's decode round and in
    the mixture's every program (its logits too; the dense model's logits compile another way
    and never failed), where the float32 models of the tests above never reach it. The dense
    model decodes (int8; FP8 takes the same product); its logits stay those of the dequantized
    weights within bfloat16's rounding (the reference rounds every dequantized weight to
    bfloat16, and both run their activations in bfloat16: 0.009-0.010 relative RMS measured; a
    product that missed its scales would be off by far more). The mixture's logits are finite
    (not compared: in bfloat16 a rounding can change which experts a token picks)."""
    from focus_jax.testing import random_prompts, tiny_model

    prompts = random_prompts(3, 128, 2, 9, seed=5)
    dense = tiny_model(seed=0, dtype="bfloat16")
    mixture = tiny_model(seed=1, scale=4.0, dtype="bfloat16", model_type="llada2_moe",
                         moe=llada2_model().config.moe, partial_rotary_factor=0.5)
    model = quant.quantize(dense, weights)
    if weights == "int8":
        config = focus_jax.GenerationConfig(mode="focus", block_size=4, max_new_tokens=8,
                                            stop_token_ids=(), bucket_ladder=(0.5, 1.0))
        results = focus_jax.generate(model, prompts, config)
        assert [len(r.token_ids) for r in results] == [8, 8, 8]
    tokens = np.asarray(prompts[0][:8] + [0] * (8 - len(prompts[0][:8])))[None]
    got = np.asarray(model.logits(tokens, 4), np.float32)
    want = np.asarray(dequantized(model, dense).logits(tokens, 4), np.float32)
    assert relative_error(got, want) < 3e-2
    experts = np.asarray(quant.quantize(mixture, weights).logits(tokens, 4), np.float32)
    assert np.isfinite(experts).all() and experts.std() > 0


def test_a_quantized_mixture_serves_without_compiling_after_warmup():
    results = serves_without_compiling(quant.quantize(llada2_model(), "int8"))
    assert all(len(r.token_ids) == 12 for r in results.values())


def test_8_bit_activations_are_refused_where_they_would_not_be_faster():
    with pytest.raises(ConfigError, match=r"fp8 activations are not served on CPUs.*fp8 weights "
                                          r"alone run on any platform"):
        focus_jax.load(DENSE, tokenizer=False, quantize=Quantization("fp8", activations_from=64))
    with pytest.raises(ConfigError, match="TPUs before v7 lack"):
        quant.check_platform(Quantization("fp8", activations_from=64), "tpu")
    quant.check_platform(Quantization("int8", activations_from=64), "tpu")  # the v5e fast path
    quant.check_platform(Quantization("fp8"), "cpu")  # weights only run anywhere


def test_unsupported_quantizations_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="quantize 'int4' is not supported; choose from int8, "
                                          "fp8"):
        focus_jax.load(DENSE, tokenizer=False, quantize="int4")
    out = focus_jax.convert(DENSE, tmp_path / "int8", quantize="int8")
    with pytest.raises(ConfigError, match="already int8; load the unquantized checkpoint"):
        focus_jax.load(out, tokenizer=False, quantize="fp8")
    folder = tmp_path / "hf_fp8"
    shutil.copytree(DENSE, folder)
    config = json.loads((folder / "config.json").read_text())
    # FP8 weights with scales load (tests/test_fp8_checkpoints.py); 4-bit GPTQ does not.
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quantization_config 'gptq' is not supported"):
        focus_jax.load(folder, tokenizer=False)
    assert main(["bench", "--geometry", "sdar-8b", "--quantize-activations-from", "64"]) == 2
    assert "--quantize-activations-from needs --quantize" in capsys.readouterr().err


def test_8_bit_experts_split_over_a_mesh_give_the_single_device_logits():
    """The experts' 8-bit weights and scales are placed by their parameters' logical axes (a
    scale is not split on its contracted axis) and enter the experts' ``shard_map`` with them."""
    root = Path(__file__).parent.parent
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4"),
           "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(root / "tests/sharding/quantized.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 3
    for row in rows:
        assert row["placed"] and row["max_difference"] < 1e-4, row


def test_bench_runs_the_model_it_was_asked_to_quantize(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "measured_bf16_peak", lambda: 4.2e10)
    monkeypatch.setattr(bench, "compile_runs",
                        lambda model, *args, **kwargs: seen.append(model) or 0.0)
    monkeypatch.setattr(bench, "run", lambda model, *args, **kwargs: seen.append(model) or [])
    assert main(["bench", "--batches", "1", "--quantize", "fp8"]) == 0  # the bundled model
    compiled, model = seen  # the same quantized model compiled for, then run
    assert compiled is model and model.config.quantization == Quantization("fp8")
    assert {var.get_value().dtype for _, var in nnx.to_flat_state(model.params)} >= {
        jnp.dtype(jnp.float8_e4m3fn)}


def test_bench_reports_mfu_against_the_measured_8bit_peak_where_activations_are_8_bit(
        capsys, monkeypatch):
    from focus_jax import checkpoint

    # 8-bit activations are refused on CPUs (nothing shows them faster there); they compute
    # correctly, so the refusal is lifted here to see the rows a GPU run writes.
    monkeypatch.setattr(checkpoint, "check_platform", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench, "measured_bf16_peak", lambda: 4e10)
    monkeypatch.setattr(bench, "measured_8bit_peak", lambda weights: {"fp8": 8e10}[weights])
    monkeypatch.setattr(bench, "compile_runs", lambda *args, **kwargs: 0.0)
    result = bench.BenchResult(
        mode="focus", batch=1, requests=1, generated_tokens=64, wall_seconds=2.0, steps=8,
        processed_per_step=32.0, retained_per_step=8.0, decoded_per_step=8.0,
        sampled_per_step=8.0, model_flops=4e10, compile_seconds=0.0, decode_seconds=1.0,
        prefill_seconds=0.5, host_seconds=0.5, compilations=0)
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: [result])
    assert main(["bench", "--batches", "1", "--quantize", "fp8",
                 "--quantize-activations-from", "64"]) == 0
    out = capsys.readouterr().out
    assert "measured bf16 peak 0.04 TFLOP/s, measured fp8 peak 0.08 TFLOP/s" in out
    # 4e10 FLOPs in 2 s of wall (1 s decoding): 50% (100%) of the bf16 peak, 25% (50%) of FP8's.
    assert "MFU  50.0% (decode 100.0%)  of the fp8 peak  25.0% (decode  50.0%)" in out


def test_the_8bit_peak_runs_an_8_bit_product_of_each_type():
    for weights in ("fp8", "int8"):
        flops = bench.measured_8bit_peak(weights, size=128, repeats=1)
        assert np.isfinite(flops) and flops > 0, (weights, flops)
