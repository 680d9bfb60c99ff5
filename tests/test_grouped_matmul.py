"""The grouped matmul's backends against its pure-jnp reference, and its dispatch.

XLA's ragged dot runs everywhere (here: the CPU). tokamax's Mosaic GPU kernel runs on an H200
with tokamax installed (``make test-gpu``); its TPU kernel is compiled for TPU chips in
``test_tpu_kernels.py``.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from pallas_kernels.grouped_matmul import api, grouped_matmul, reference, tokamax_mosaic

# (rows, k, n, group sizes): rows past the sizes' sum are padding. k and n are multiples of 64,
# as the GPU kernel needs (every expert projection's are); row counts are not multiples of 8.
CASES = {
    "mixed": (37, 64, 128, [3, 0, 20, 4, 0]),             # empty groups, 10 padding rows
    "one_group": (19, 128, 64, [0, 19, 0]),                # every row in the middle group
    "first_and_last": (64, 64, 64, [30, 0, 0, 34]),        # no padding
    "all_padding": (12, 64, 64, [0, 0]),                   # no row in any group
    "one_row": (1, 64, 64, [1]),
}
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}

BF16_OPERANDS = (jax.ShapeDtypeStruct((8, 64), jnp.bfloat16),
                 jax.ShapeDtypeStruct((2, 64, 64), jnp.bfloat16))
ON_HOPPER = (jax.default_backend() == "gpu" and tokamax_mosaic.installed()
             and tokamax_mosaic.unsupported(*BF16_OPERANDS, "gpu") is None)
needs_hopper = pytest.mark.skipif(not ON_HOPPER,
                                  reason="tokamax's Mosaic GPU kernel needs a Hopper GPU and tokamax")
HOPPER_MARKS = [pytest.mark.gpu, needs_hopper]
GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu",
                                                 reason="needs a GPU")]


def inputs(rows: int, k: int, n: int, sizes: list[int], dtype, seed: int = 0):
    """Random operands scaled so that every output is about unit size."""
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(rows, k)) / np.sqrt(k), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def check_against_reference(impl: str, case: str, dtype, out_dtype=None) -> None:
    rows, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = inputs(rows, k, n, sizes, dtype)
    got = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl=impl,
                                                 preferred_element_type=out_dtype))(
        lhs, rhs, group_sizes)
    want = reference.grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    assert got.shape == (rows, n) and got.dtype == want.dtype == (out_dtype or dtype)
    used = sum(sizes)
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    tolerance = TOLERANCE[out_dtype or dtype]
    np.testing.assert_allclose(got[:used], want[:used], rtol=tolerance, atol=tolerance)
    np.testing.assert_array_equal(got[used:], 0.0)  # padding rows: zeros, never left undefined


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES)
def test_xla_matches_reference(case, dtype):
    check_against_reference("xla", case, dtype)


def test_xla_with_bf16_inputs_accumulates_in_float32():
    check_against_reference("xla", "mixed", jnp.bfloat16, out_dtype=jnp.float32)


def test_reference_rows_pick_their_group():
    """The reference itself, by hand: row r of group i is lhs[r] @ rhs[i]."""
    lhs, rhs, group_sizes = inputs(7, 4, 3, [2, 0, 3], jnp.float32)
    out = np.asarray(reference.grouped_matmul(lhs, rhs, group_sizes))
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    for row, group in enumerate([0, 0, 2, 2, 2]):
        np.testing.assert_allclose(out[row], lhs[row] @ rhs[group], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[5:], 0.0)
    np.testing.assert_array_equal(reference.row_groups(group_sizes, 7), [0, 0, 2, 2, 2, 3, 3])


def test_cpu_default_is_xla_and_named_tokamax_is_a_clear_error():
    lhs, rhs, group_sizes = inputs(*CASES["mixed"], jnp.float32)
    np.testing.assert_array_equal(grouped_matmul(lhs, rhs, group_sizes),
                                  grouped_matmul(lhs, rhs, group_sizes, impl="xla"))
    with pytest.raises(ValueError, match=r"impl='tokamax' cannot run here: .* not on cpu"):
        grouped_matmul(lhs, rhs, group_sizes, impl="tokamax")
    with pytest.raises(ValueError, match="unknown impl 'triton'"):
        grouped_matmul(lhs, rhs, group_sizes, impl="triton")


def test_bad_shapes_are_clear_errors():
    lhs, rhs, group_sizes = inputs(*CASES["mixed"], jnp.float32)
    with pytest.raises(ValueError, match=r"does not contract"):
        grouped_matmul(lhs[:, :5], rhs, group_sizes)
    with pytest.raises(ValueError, match=r"group_sizes \[g\]"):
        grouped_matmul(lhs, rhs, group_sizes[:2])
    with pytest.raises(ValueError, match="must be integers"):
        grouped_matmul(lhs, rhs, group_sizes.astype(jnp.float32))


def test_accelerator_without_tokamax_falls_back_to_xla_with_one_warning(monkeypatch):
    monkeypatch.setattr(api, "target_platform", lambda: "gpu")
    monkeypatch.setattr(tokamax_mosaic, "installed", lambda: False)
    api._warn_once.cache_clear()
    lhs, rhs, group_sizes = inputs(*CASES["mixed"], jnp.bfloat16)
    with pytest.warns(UserWarning, match="tokamax is not installed"):
        got = grouped_matmul(lhs, rhs, group_sizes)
    np.testing.assert_array_equal(got, grouped_matmul(lhs, rhs, group_sizes, impl="xla"))
    with pytest.raises(ValueError, match="tokamax is not installed"):
        grouped_matmul(lhs, rhs, group_sizes, impl="tokamax")


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is None, reason="tokamax is not installed")
def test_tokamax_capability_follows_platform_dtype_and_shape():
    def operands(k: int, n: int, lhs_dtype, rhs_dtype=None):
        return (jax.ShapeDtypeStruct((40, k), lhs_dtype),
                jax.ShapeDtypeStruct((4, k, n), rhs_dtype or lhs_dtype))

    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    assert "not on cpu" in tokamax_mosaic.unsupported(*operands(64, 64, bf16), "cpu")
    assert "one dtype" in tokamax_mosaic.unsupported(*operands(64, 64, bf16, f32), "tpu")
    assert "bfloat16 or float16, not float32" in tokamax_mosaic.unsupported(
        *operands(64, 64, f32), "gpu")
    assert "bfloat16, not float16" in tokamax_mosaic.unsupported(*operands(64, 64, f16), "tpu")
    assert "k=96, n=128" in tokamax_mosaic.unsupported(*operands(96, 128, bf16), "gpu")
    assert "k=64, n=48" in tokamax_mosaic.unsupported(*operands(64, 48, f16), "gpu")


@pytest.mark.parametrize(("dtype", "out_dtype"), [(jnp.bfloat16, None), (jnp.float16, None),
                                                  (jnp.bfloat16, jnp.float32)],
                         ids=["bf16", "f16", "bf16_to_f32"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", [pytest.param("tokamax", marks=HOPPER_MARKS),
                                  pytest.param("xla", marks=GPU_MARKS)])
def test_gpu_backends_match_reference(impl, case, dtype, out_dtype):
    check_against_reference(impl, case, dtype, out_dtype)


@pytest.mark.parametrize("qtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("impl", [pytest.param("tokamax", marks=HOPPER_MARKS), "xla"])
def test_8_bit_weights_multiply_as_their_dequantized_values(impl, qtype):
    """8-bit experts (a scale per output channel and expert, docs/quantization.md): the product
    of the bf16 rows with the weights as dequantized, padding rows zeros."""
    rows, k, n, sizes = CASES["mixed"]
    lhs, rhs, group_sizes = inputs(rows, k, n, sizes, jnp.bfloat16)
    weights = qwix.quantize(rhs, qtype, channelwise_axes=(0, 2))
    if impl == "tokamax" and (why := tokamax_mosaic.unsupported(lhs, weights, "gpu")):
        # FP8 weights with bf16 rows where ptxas is older than PTX ISA 9.2 (the H200 image's):
        # the default dispatch takes XLA's ragged dot (with a warning that says why).
        assert qtype == jnp.float8_e4m3fn and "ptxas" in why, why
        assert api._default(lhs, weights, "gpu") == "xla"
        impl = None
    got = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl=impl,
                                                 preferred_element_type=jnp.float32))(
        lhs, weights, group_sizes)
    want = reference.grouped_matmul(lhs, qwix.dequantize(weights), group_sizes,
                                    preferred_element_type=jnp.float32)
    used = sum(sizes)
    np.testing.assert_allclose(np.asarray(got)[:used], np.asarray(want)[:used], rtol=2e-2,
                               atol=2e-2)
    np.testing.assert_array_equal(np.asarray(got)[used:], 0.0)


def test_fp8_weights_leave_tokamax_only_where_ptxas_cannot_convert_them_to_the_rows_dtype():
    """tokamax's Hopper kernel converts 8-bit weights to the rows' dtype in registers; Mosaic
    GPU converts FP8 to bfloat16 only from PTX ISA 9.2 (an H100 with the H200 image's CUDA failed
    with "Hardware has no support for converting from f8E4M3FN to bf16")."""
    why = tokamax_mosaic.fp8_weights_unsupported(jnp.bfloat16, jnp.float8_e4m3fn, 88)
    assert why and "PTX ISA 8.8" in why and "int8 weights keep the kernel" in why
    assert tokamax_mosaic.fp8_weights_unsupported(jnp.bfloat16, jnp.float8_e4m3fn, 92) is None
    assert tokamax_mosaic.fp8_weights_unsupported(jnp.float16, jnp.float8_e4m3fn, 88) is None
    assert tokamax_mosaic.fp8_weights_unsupported(jnp.bfloat16, jnp.int8, 0) is None


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rows", [64, 200, 2048])
@pytest.mark.parametrize("shape", [(2048, 1536), (768, 2048), (256, 384)], ids=str)
def test_tokamax_at_expert_shapes_matches_reference(shape, rows):
    """SDAR-30B-A3B's gate-up and down projections (and a small one), 16 experts, tokens routed
    at random with some experts left empty, and a quarter of the rows as padding."""
    k, n = shape
    rng = np.random.default_rng(rows)
    experts = rng.integers(0, 16, size=rows - rows // 4)
    experts[experts == 3] = 4                      # expert 3 gets no token
    sizes = np.bincount(experts, minlength=16)
    lhs, rhs, group_sizes = inputs(rows, k, n, list(sizes), jnp.bfloat16, seed=rows)
    got = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl="tokamax",
                                                 preferred_element_type=jnp.float32))(
        lhs, rhs, group_sizes)
    want = reference.grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    used = int(sizes.sum())
    np.testing.assert_allclose(np.asarray(got)[:used], np.asarray(want)[:used], rtol=1e-3,
                               atol=1e-3)
    np.testing.assert_array_equal(np.asarray(got)[used:], 0.0)


@pytest.mark.gpu
@needs_hopper
def test_gpu_default_is_tokamax_where_it_runs_else_xla():
    """bf16 at aligned shapes: the Mosaic GPU kernel. float32, or k not a multiple of 64: XLA's
    ragged dot, and a named ``tokamax`` is a clear error."""
    lhs, rhs, group_sizes = inputs(*CASES["mixed"], jnp.bfloat16)
    lower = lambda *args: jax.jit(grouped_matmul).lower(*args).as_text()
    assert "mosaic_gpu" in lower(lhs, rhs, group_sizes)
    assert "mosaic_gpu" not in lower(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                                     group_sizes)
    unaligned = inputs(37, 96, 128, [3, 0, 20, 4, 0], jnp.bfloat16)
    assert "mosaic_gpu" not in lower(*unaligned)
    with pytest.raises(ValueError, match="multiples of 64"):
        grouped_matmul(*unaligned, impl="tokamax")


def test_tokamax_autotuning_misses_are_not_shown(caplog):
    import logging

    from pallas_kernels.grouped_matmul import tokamax_mosaic

    tokamax_mosaic._quiet_autotuning_misses()
    with caplog.at_level(logging.WARNING, logger="absl"):
        logging.getLogger("absl").warning("Autotuning cache miss for PallasMosaicGpuRaggedDot")
        logging.getLogger("absl").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_tuned_config_is_that_of_the_nearest_tuned_row_count(tmp_path, monkeypatch):
    table = {"shapes": {"2048x1536x128": [
        {"rows": 4096, "config": {"block_m": 64}}, {"rows": 65536, "config": {"block_m": 128}}],
        "2048x1536x128:int8": [{"rows": 4096, "config": {"block_m": 16}}]}}
    (tmp_path / "some_gpu_x.json").write_text(__import__("json").dumps(table))
    monkeypatch.setattr(tokamax_mosaic, "TUNED", tmp_path)
    tokamax_mosaic.tuned_table.cache_clear()
    try:
        pick = lambda rows: tokamax_mosaic.tuned_config("Some GPU X", rows, 2048, 1536, 128)
        assert pick(8) == {"block_m": 64}
        assert pick(16000) == {"block_m": 64}        # nearer 4,096 than 65,536 by ratio
        assert pick(17000) == {"block_m": 128}
        assert pick(10**6) == {"block_m": 128}
        assert tokamax_mosaic.tuned_config("Some GPU X", 4096, 2048, 1536, 64) is None
        assert tokamax_mosaic.tuned_config("Another GPU", 4096, 2048, 1536, 128) is None
        # 8-bit weights run a kernel of their own: their configs, never the 16-bit ones.
        assert tokamax_mosaic.tuned_config("Some GPU X", 10**6, 2048, 1536, 128, "int8") == {
            "block_m": 16}
        assert tokamax_mosaic.tuned_config("Some GPU X", 4096, 2048, 1536, 128,
                                           "float8_e4m3fn") is None
        assert tokamax_mosaic.parse_shape_key("2048x1536x128:int8") == (2048, 1536, 128, "int8")
        assert tokamax_mosaic.parse_shape_key("2048x1536x128") == (2048, 1536, 128, None)
    finally:
        tokamax_mosaic.tuned_table.cache_clear()


@pytest.mark.skipif(not tokamax_mosaic.installed(), reason="tokamax is not installed")
def test_every_shipped_tuned_config_is_a_valid_tokamax_config():
    tables = sorted(tokamax_mosaic.TUNED.glob("*.json"))
    if not tables:
        pytest.skip("no tuned tables shipped yet")
    for path in tables:
        for shape, entries in __import__("json").loads(path.read_text())["shapes"].items():
            k, n, groups, weights = tokamax_mosaic.parse_shape_key(shape)
            assert k % 64 == 0 and n % 64 == 0 and groups > 0, (path.name, shape)
            assert weights in (None, "int8"), (path.name, shape)
            for entry in entries:
                assert entry["tflops"] > entry["heuristic_tflops"], (path.name, shape, entry)
                assert tokamax_mosaic.op(entry["config"]).config.block_m == entry["config"]["block_m"]


@pytest.mark.gpu
@needs_hopper
def test_tuned_configs_of_this_gpu_match_reference():
    """Every config tuned for this GPU kind, at its shape (with int8 weights where tuned for
    them), on 512 rows routed at random with padding rows: the reference's values, zeros past
    the groups."""
    import tokamax

    shapes = tokamax_mosaic.tuned_table(jax.devices()[0].device_kind)
    if not shapes:
        pytest.skip(f"no tuned configs for {jax.devices()[0].device_kind}")
    rng = np.random.default_rng(0)
    for shape, entries in shapes.items():
        k, n, groups, weights = tokamax_mosaic.parse_shape_key(shape)
        sizes = np.bincount(rng.integers(0, groups, size=448), minlength=groups)
        lhs, rhs, group_sizes = inputs(512, k, n, list(sizes), jnp.bfloat16, seed=k + n)
        out_dtype = jnp.float32
        if weights:
            rhs = qwix.quantize(rhs, jnp.dtype(weights), channelwise_axes=(0, 2))
            out_dtype = jnp.bfloat16  # the 8-bit kernel writes 16-bit tiles
        want = reference.grouped_matmul(
            lhs, qwix.dequantize(rhs) if weights else rhs, group_sizes,
            preferred_element_type=jnp.float32)
        tolerance = 2e-2 if weights else 1e-3
        for entry in entries:
            impl = [tokamax_mosaic.op(entry["config"])]
            with tokamax_mosaic._one_pass(jnp.bfloat16):
                got = jax.jit(lambda a, b, c, impl=impl, out_dtype=out_dtype: tokamax.ragged_dot(
                    a, b, c, preferred_element_type=out_dtype, implementation=impl))(
                    lhs, rhs, group_sizes)
            np.testing.assert_allclose(np.asarray(got, np.float32)[:448],
                                       np.asarray(want)[:448], rtol=tolerance, atol=tolerance,
                                       err_msg=f"{shape} {entry['config']}")
