"""Hugging Face folders of FP8 weights with scales (a scale per block, per channel or per
tensor) load dequantized: the same parameters as a folder holding the dequantized weights.

The formats, from their public descriptions: Qwen's and DeepSeek's FP8 releases store each
linear weight in float8 e4m3 with ``weight_scale_inv`` of shape ``[ceil(out / 128), ceil(in /
128)]``, the weight being ``fp8 * scale_inv`` block by block (``quant_method: fp8``,
``weight_block_size: [128, 128]``); compressed-tensors' ``float-quantized`` format (and
FBGEMM's) stores ``weight_scale`` of shape ``[out, 1]`` (per channel) or one number (per
tensor), and may store static activation scales (``input_scale``) as well.
"""

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import focus_jax
from focus_jax import ConfigError
from focus_jax.testing import char_tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "parity" / "qwen3_untied"
FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(FP8).max)


def linear_weights(tensors: dict[str, np.ndarray]) -> list[str]:
    """The attention and MLP projections: the weights FP8 releases store in 8 bits."""
    return sorted(k for k in tensors if k.endswith("proj.weight") and tensors[k].ndim == 2)


def blockwise(weight: np.ndarray, rows: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """FP8 values and a scale per ``rows x columns`` tile (the last tiles cut at the edges),
    tile by tile: each tile's largest magnitude maps to FP8's largest."""
    out, inputs = weight.shape
    scale = np.zeros((-(-out // rows), -(-inputs // columns)), np.float32)
    values = np.zeros(weight.shape, FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * rows:(i + 1) * rows, j * columns:(j + 1) * columns].astype(np.float32)
            scale[i, j] = max(np.abs(tile).max(), 1e-12) / FP8_MAX
            values[i * rows:(i + 1) * rows, j * columns:(j + 1) * columns] = (
                tile / scale[i, j]).astype(FP8)
    return values, scale


def dequantized_blockwise(values: np.ndarray, scale: np.ndarray, rows: int,
                          columns: int) -> np.ndarray:
    """The weight an FP8 folder stands for, tile by tile."""
    out = values.astype(np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * rows:(i + 1) * rows, j * columns:(j + 1) * columns] *= scale[i, j]
    return out


def folder_with(tmp_path: Path, name: str, tensors: dict[str, np.ndarray],
                quantization: dict | None) -> Path:
    """The parity checkpoint's folder (a tokenizer, a mask id) with these tensors."""
    folder = tmp_path / name
    shutil.copytree(FIXTURE, folder)
    char_tokenizer().save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["mask_token_id"] = 2
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def assert_same_params(a, b):
    flat_a = dict(jax.tree.leaves_with_path(nnx.to_pure_dict(a.params)))
    flat_b = dict(jax.tree.leaves_with_path(nnx.to_pure_dict(b.params)))
    assert flat_a.keys() == flat_b.keys()
    for path, value in flat_a.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flat_b[path]),
                                      err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_folder_of_fp8_blocks_loads_as_its_dequantized_weights(tmp_path, dtype):
    """Tiles of 24 x 40 (not dividing the 64- and 128-wide weights: the edge tiles are cut),
    as ``quant_method: fp8`` with ``weight_block_size``."""
    original = load_file(str(FIXTURE / "model.safetensors"))
    fp8, plain = dict(original), dict(original)
    for key in linear_weights(original):
        values, scale = blockwise(original[key], 24, 40)
        fp8[key], fp8[key + "_scale_inv"] = values, scale
        plain[key] = dequantized_blockwise(values, scale, 24, 40)
    quantized = folder_with(tmp_path, "fp8", fp8, {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [24, 40]})
    reference = folder_with(tmp_path, "plain", plain, None)
    loaded = focus_jax.load(quantized, dtype=dtype)
    assert loaded.config.quantization is None  # dequantized, not focus_jax's 8-bit weights
    assert_same_params(loaded, focus_jax.load(reference, dtype=dtype))
    # And the FP8 rounding did change the weights (the test would hold trivially otherwise).
    key = linear_weights(original)[0]
    assert not np.array_equal(plain[key], original[key].astype(np.float32))


@pytest.mark.parametrize("per", ["channel", "tensor"])
def test_compressed_tensors_fp8_with_a_scale_per_channel_or_tensor_loads(tmp_path, per):
    """``weight_scale`` of shape ``[out, 1]`` or one number; ``input_scale`` is skipped; the
    model can be made 8-bit again with ``quantize="fp8"``."""
    original = load_file(str(FIXTURE / "model.safetensors"))
    fp8, plain = dict(original), dict(original)
    for key in linear_weights(original):
        weight = original[key].astype(np.float32)
        peak = np.abs(weight).max(axis=1, keepdims=True) if per == "channel" else np.abs(weight).max()
        scale = np.asarray(peak / FP8_MAX, np.float32)
        values = (weight / scale).astype(FP8)
        fp8[key], fp8[key.replace(".weight", ".weight_scale")] = values, scale
        fp8[key.replace(".weight", ".input_scale")] = np.ones((), np.float32)
        plain[key] = values.astype(np.float32) * scale
    quantized = folder_with(tmp_path, "fp8", fp8, {
        "quant_method": "compressed-tensors", "format": "float-quantized"})
    reference = folder_with(tmp_path, "plain", plain, None)
    assert_same_params(focus_jax.load(quantized, dtype="float32"),
                       focus_jax.load(reference, dtype="float32"))
    eight_bit = focus_jax.load(quantized, quantize="fp8")
    assert eight_bit.config.quantization.weights == "fp8"


def test_fp8_weights_without_their_scales_and_other_methods_are_one_line_errors(tmp_path):
    original = load_file(str(FIXTURE / "model.safetensors"))
    key = linear_weights(original)[0]
    fp8 = {**original, key: original[key].astype(FP8)}
    lacking = folder_with(tmp_path, "lacking", fp8, {"quant_method": "fp8",
                                                     "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match=rf"{key}.*FP8 without a {key}_scale_inv"):
        focus_jax.load(lacking)
    wrong = folder_with(tmp_path, "wrong", {**fp8, key + "_scale_inv": np.ones((3, 3), np.float32)},
                        {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match=r"128 x 128 blocks of a \d+ x \d+ weight need \(1, 1\)"):
        focus_jax.load(wrong)
    packed = folder_with(tmp_path, "packed", original, {"quant_method": "compressed-tensors",
                                                        "format": "pack-quantized"})
    with pytest.raises(ConfigError, match=r"'compressed-tensors' is not supported.*float-quantized"):
        focus_jax.load(packed)
