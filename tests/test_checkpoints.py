"""Loading Hugging Face and converted folders, and the errors a user can hit."""

import json
import shutil
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import focus_jax
from focus_jax import ConfigError, GenerationConfig, RequestError
from focus_jax.testing import char_tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "parity" / "qwen3_untied"


@pytest.fixture
def hf_folder(tmp_path) -> Path:
    """A copy of a parity checkpoint with a tokenizer and a mask token id."""
    folder = tmp_path / "hf"
    shutil.copytree(FIXTURE, folder)
    char_tokenizer().save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["mask_token_id"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tokens() -> np.ndarray:
    return np.load(FIXTURE / "reference_logits.npz")["tokens"]


def test_convert_then_load_gives_the_same_logits(hf_folder, tmp_path):
    original = focus_jax.load(hf_folder, dtype="float32")
    out = focus_jax.convert(hf_folder, tmp_path / "converted", dtype="float32")
    assert (out / "params").is_dir() and (out / "tokenizer.json").exists()
    converted = focus_jax.load(out)
    np.testing.assert_array_equal(np.asarray(original.logits(tokens(), 4)),
                                  np.asarray(converted.logits(tokens(), 4)))
    assert converted.tokenizer.mask_token_id == 2 and converted.mask_token_id == 2


def test_sharded_safetensors_with_index_load(hf_folder):
    tensors = load_file(str(hf_folder / "model.safetensors"))
    (hf_folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(hf_folder / file))
        weight_map.update(dict.fromkeys(keys, file))
    (hf_folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = focus_jax.load(hf_folder, dtype="float32")
    expected = np.load(FIXTURE / "reference_logits.npz")["logits_b4"]
    assert np.abs(np.asarray(model.logits(tokens(), 4)) - expected).max() <= 1e-4


def test_safetensors_reader_equals_the_safetensors_library(tmp_path):
    import ml_dtypes
    from safetensors.flax import load_file as load_flax
    from safetensors.flax import save_file as save_flax

    from focus_jax.models.weights import read_safetensors

    rng = np.random.default_rng(0)
    arrays = {"a": rng.normal(size=(3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int64),
              "c": rng.normal(size=(2, 2, 4)).astype(ml_dtypes.bfloat16), "d": np.float16(1.5)}
    save_flax({k: jnp.asarray(v) for k, v in arrays.items()}, str(tmp_path / "m.safetensors"))
    ours = read_safetensors(tmp_path / "m.safetensors")
    theirs = load_flax(str(tmp_path / "m.safetensors"))
    assert sorted(ours) == sorted(theirs) == sorted(arrays)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
        np.testing.assert_array_equal(ours[key], np.asarray(value))
    whole = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[:-8])
    with pytest.raises(ConfigError, match="truncated"):
        read_safetensors(tmp_path / "cut.safetensors")


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        focus_jax.load(tmp_path / "nowhere")


def test_broken_config_json_is_a_clear_error(hf_folder):
    (hf_folder / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        focus_jax.load(hf_folder)


def test_unknown_model_type_is_a_clear_error(hf_folder):
    config = json.loads((hf_folder / "config.json").read_text())
    config["model_type"] = "llama"
    (hf_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported"):
        focus_jax.load(hf_folder)


def test_config_that_disagrees_with_the_weights_is_a_clear_error(hf_folder):
    config = json.loads((hf_folder / "config.json").read_text())
    config["intermediate_size"] += 8
    (hf_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="has shape"):
        focus_jax.load(hf_folder)


def test_missing_weights_and_missing_tokenizer_are_clear_errors(hf_folder):
    (hf_folder / "tokenizer.json").unlink()
    (hf_folder / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        focus_jax.load(hf_folder)
    (hf_folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        focus_jax.load(hf_folder, tokenizer=False)


def _special(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def _qwen2_style_tokenizer(folder: Path, mask: str | None = "<|MASK|>") -> None:
    """SDAR's tokenizer layout, tiny: vocab.json, merges.txt, and a tokenizer_config.json that
    names its mask token and gives its id in added_tokens_decoder."""
    (folder / "vocab.json").write_text(json.dumps({ch: i for i, ch in enumerate("abcdefgh")}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>",
              "added_tokens_decoder": {"8": _special("<|endoftext|>"), "9": _special("<|MASK|>")}}
    if mask is not None:
        config["mask_token"] = mask
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_the_mask_id_read_from_the_tokenizer_files_is_the_loaded_tokenizers(tmp_path):
    from focus_jax.checkpoint import load_tokenizer, mask_token_id_from_files

    # tokenizer.json's added_tokens (the bundled model), added_tokens_decoder (SDAR's layout)
    sdar = tmp_path / "sdar"
    sdar.mkdir()
    _qwen2_style_tokenizer(sdar)
    for folder in (focus_jax.BUNDLED_MODEL, sdar):
        assert mask_token_id_from_files(folder) == load_tokenizer(folder).mask_token_id
    assert mask_token_id_from_files(sdar) == 9
    unnamed = tmp_path / "unnamed"  # no mask_token: the files do not say, the tokenizer decides
    unnamed.mkdir()
    _qwen2_style_tokenizer(unnamed, mask=None)
    assert mask_token_id_from_files(unnamed) is None


def test_a_folder_is_described_and_its_weights_loaded_while_its_tokenizer_still_loads(
        hf_folder, monkeypatch):
    from focus_jax import checkpoint

    config = json.loads((hf_folder / "config.json").read_text())
    del config["mask_token_id"]  # the mask comes from the tokenizer's files
    (hf_folder / "config.json").write_text(json.dumps(config))
    expected = focus_jax.load(hf_folder, dtype="float32")
    release, original = threading.Event(), checkpoint.load_tokenizer

    def slow_load(folder):
        assert release.wait(timeout=60)
        return original(folder)

    monkeypatch.setattr(checkpoint, "load_tokenizer", slow_load)
    pending = checkpoint.TokenizerLoad(hf_folder)
    described = checkpoint.describe(hf_folder, dtype="float32", tokenizer=pending)
    assert described.tokenizer is None and described.mask_token_id == expected.mask_token_id == 2
    release.set()
    model = checkpoint.load_weights(described, hf_folder, tokenizer=pending)
    assert model.tokenizer is pending.result()
    assert model.tokenizer.encode("abc") == expected.tokenizer.encode("abc")
    assert model.stop_token_ids == expected.stop_token_ids and model.mask_token_id == 2
    np.testing.assert_array_equal(np.asarray(model.logits(tokens(), 4)),
                                  np.asarray(expected.logits(tokens(), 4)))


def test_a_tokenizer_that_disagrees_with_its_files_on_the_mask_is_a_clear_error(hf_folder,
                                                                                 monkeypatch):
    from focus_jax import checkpoint

    config = json.loads((hf_folder / "config.json").read_text())
    del config["mask_token_id"]
    (hf_folder / "config.json").write_text(json.dumps(config))
    loaded = checkpoint.load_tokenizer(hf_folder)
    monkeypatch.setattr(checkpoint, "load_tokenizer",
                        lambda folder: type("Other", (), {"mask_token_id": 3,
                                                          "eos_token_id": loaded.eos_token_id})())
    with pytest.raises(ConfigError, match="gives mask token id 3, its files 2"):
        focus_jax.load(hf_folder, dtype="float32")


def test_prompt_longer_than_the_cache_is_a_clear_error(model):
    config = GenerationConfig(mode="baseline", block_size=4, max_new_tokens=8, max_cache_len=16)
    with pytest.raises(RequestError, match="cache holds 16"):
        focus_jax.generate(model, list(range(10, 22)), config)


def test_block_size_the_model_was_not_trained_for_is_a_clear_error(model):
    trained = focus_jax.Model(model.config.replace(block_size=8), model.graphdef, model.params,
                              model.tokenizer, model.stop_token_ids)
    with pytest.raises(ConfigError, match="trained with block size 8"):
        focus_jax.generate(trained, [5, 6, 7], GenerationConfig(block_size=4))


class _Device:
    """A device reporting its memory as GPUs and TPUs do (CPUs report none)."""

    platform, process_index = "gpu", 0

    def __init__(self, limit: int | None, in_use: int = 0):
        self.limit, self.in_use = limit, in_use

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit,
                                                "bytes_in_use": self.in_use}


def test_weights_and_decode_state_that_do_not_fit_the_device_are_a_clear_error(model,
                                                                              monkeypatch):
    import jax
    from jax.sharding import AbstractMesh

    from focus_jax import sharding
    from focus_jax.decoding import init_state
    from focus_jax.engine import Engine, check_memory_fits

    shapes = jax.eval_shape(lambda: init_state(model.config, 8, 256, 4, 1))
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    # Shapes of the weights: none of them is on a device yet.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.params)

    def fits(params, devices, mesh=None) -> None:
        check_memory_fits(params, shapes, devices, mesh, 8, 256)

    fits(abstract, [_Device(weights + state + 1000, in_use=1000)])
    fits(abstract, [_Device(None)])  # no memory report: not checked
    other_process = _Device(1)
    other_process.process_index = 1
    fits(abstract, [_Device(weights + state), other_process])  # reports for its own only
    # Slots over data=2: each device holds half the state (and, replicated, all the weights).
    two = AbstractMesh((2, 1, 1), sharding.AXES)
    on_each = sharding.resident_bytes(abstract, shapes, two)
    assert on_each.decode_state < state and on_each.weights == weights
    fits(abstract, [_Device(on_each.total)] * 2, two)
    with pytest.raises(ConfigError, match=r"8 slots x 256 cache positions.*fewer slots"):
        fits(abstract, [_Device(on_each.total - 1)] * 2, two)
    # The state alone would fit; with the weights it does not. One line naming both.
    with pytest.raises(ConfigError) as refused:
        fits(abstract, [_Device(weights + state + 1000, in_use=1001)])
    message = str(refused.value)
    assert "the weights (" in message and "the decode state (" in message
    assert "\n" not in message
    # The engine checks before it allocates.
    monkeypatch.setattr(jax, "local_devices", lambda *args: [_Device(weights + state // 4)])
    with pytest.raises(ConfigError, match=r"[KMG]iB are free"):
        Engine(model, GenerationConfig(block_size=4), slots=8, cache_len=256)


def test_a_device_out_of_memory_for_the_warm_ups_temporaries_is_a_one_line_error(model,
                                                                                 monkeypatch):
    """XLA's allocation failure while the warm-up runs a program (its temporaries are not in
    the checked weights and decode state) becomes a ConfigError naming the shape; other
    runtime errors pass through."""
    import jax

    from focus_jax import compilation
    from focus_jax.engine import Engine

    engine = Engine(model, GenerationConfig(block_size=4), slots=8, cache_len=256)
    monkeypatch.setattr(compilation, "compile_together", lambda *args, **kwargs: None)

    def fail(message):
        def run(*args):
            raise jax.errors.JaxRuntimeError(message)
        return run

    oom = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 19.12GiB with allocator "
           "GPU_0_bfc on device 0. [executable_name='jit_decode_round'] "
           "[tf-allocator-allocation-error='']")
    monkeypatch.setattr(engine.runner, "_run_prefill", fail(oom))
    # A failed device program leaves its error in JAX's runtime tokens, which its exit hooks
    # would raise again: the reported failure's tokens are dropped.
    from jax._src import dispatch

    dispatch.runtime_tokens.output_runtime_tokens[jax.devices()[0]] = "the failed program's"
    with pytest.raises(ConfigError) as refused:
        engine.warmup(prompt_lengths=[5])
    assert not dispatch.runtime_tokens.output_runtime_tokens
    message = str(refused.value)
    assert "out of memory warming up 8 slots x 256 cache positions" in message, message
    assert "allocate 19.12GiB" in message and "fewer slots" in message and "\n" not in message
    monkeypatch.setattr(engine.runner, "_run_prefill", fail("INTERNAL: something else"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        engine.warmup(prompt_lengths=[5])


def test_generate_on_a_device_too_small_for_the_request_is_a_one_line_error(monkeypatch,
                                                                            capsys):
    import jax

    from focus_jax.cli import main

    # 8 MiB: room for the decode state (2 MiB), not for the bundled model's weights with it.
    monkeypatch.setattr(jax, "local_devices", lambda *args: [_Device(8 * 2**20)])
    code = main(["generate", "--prompt", "hi", "--max-new-tokens", "500"])
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = [line for line in err.splitlines() if "focus-jax: error" in line]
    assert "the weights (" in line and "x 512 cache positions" in line, line
    assert "8.00 MiB are free" in line and "Traceback" not in err


class _Holding(_Device):
    """A real device (its arrays are there) that reports a memory of ``limit`` bytes."""

    def __init__(self, device, limit: int, in_use: int):
        super().__init__(limit, in_use)
        self.device = device

    def __hash__(self):
        return hash(self.device)

    def __eq__(self, other):
        return other is self or other == self.device


def test_weights_already_on_the_device_count_as_free_there(model):
    """The engine gets weights already loaded: they move into place, they are not added."""
    import jax

    from focus_jax import sharding
    from focus_jax.decoding import init_state
    from focus_jax.engine import check_memory_fits

    device = jax.devices()[0]
    placed = jax.device_put(model.params, device)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    assert sharding.bytes_on(placed, device) == weights
    shapes = jax.eval_shape(lambda: init_state(model.config, 8, 256, 4, 1))
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    check_memory_fits(placed, shapes, [_Holding(device, weights + state, in_use=weights)], None,
                      8, 256)
    with pytest.raises(ConfigError, match=r"[KMG]iB are free"):
        check_memory_fits(placed, shapes, [_Holding(device, weights + state - 1, in_use=weights)],
                          None, 8, 256)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mode", "fast", "mode 'fast'"), ("threshold", 1.5, "threshold"), ("block_size", 7, "block_size 7"),
    ("top_p", 0.0, "top_p"), ("max_new_tokens", 0, "max_new_tokens"),
])
def test_bad_generation_settings_are_rejected_on_construction(field, value, message):
    with pytest.raises(ConfigError, match=message):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize(("damage", "culprit"), [
    (lambda d: (d / "tokenizer.json").write_text("{ not json"), r"tokenizer\.json is not valid JSON"),
    (lambda d: (d / "tokenizer.json").write_bytes(b"\xff{}"), r"tokenizer\.json is not UTF-8"),
    (lambda d: (d / "tokenizer_config.json").write_bytes(b"\xff{}"),
     r"tokenizer_config\.json is not UTF-8"),
    (lambda d: (d / "config.json").write_bytes(b"\xff{}"), r"config\.json is not UTF-8"),
    (lambda d: (d / "generation_config.json").write_text("{ bad"),
     r"generation_config\.json is not valid JSON"),
    (lambda d: (d / "generation_config.json").write_bytes(b"\xfe"),
     r"generation_config\.json is not UTF-8"),
    (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": "x"}'),
     r"generation_config\.json must be a JSON object whose eos_token_id"),
    (lambda d: (d / "model.safetensors").write_bytes(b""),
     r"model\.safetensors is not a safetensors file \(0 bytes\)"),
    (lambda d: (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "model-2.safetensors"}}'),
     r"lacks shard\(s\) named in its index: model-2\.safetensors"),
    (lambda d: (d / "model.safetensors.index.json").write_bytes(b"[]"),
     r"index\.json is not a safetensors index"),
    (lambda d: (d / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((d / "tokenizer_config.json").read_text()), "merges_file": "merges.txt"})),
     r"tokenizer_config\.json names merges\.txt, which the folder lacks"),
])
def test_a_damaged_file_is_a_load_error_naming_it(hf_folder, damage, culprit):
    damage(hf_folder)
    with pytest.raises(ConfigError, match=culprit):
        focus_jax.load(hf_folder)


def test_a_checkpoint_without_one_part_of_a_fused_weight_names_it(hf_folder):
    """Keys and values are one of our weights (as are the MLP's gate and up projections): a
    checkpoint without the values names them."""
    tensors = load_file(hf_folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith("self_attn.v_proj.weight")},
              hf_folder / "model.safetensors")
    with pytest.raises(ConfigError, match=r"lack self_attn\.v_proj\.weight"):
        focus_jax.load(hf_folder)


def test_saved_safetensors_are_the_loaded_ones_tensor_for_tensor(hf_folder, tmp_path):
    """Our fused weights are written back as the Hugging Face tensors they were read from."""
    from focus_jax.models.weights import save_safetensors

    model = focus_jax.load(hf_folder, dtype="float32")
    files = save_safetensors(nnx.merge(model.graphdef, model.params), tmp_path / "out")
    saved = {k: v for f in files for k, v in load_file(f).items()}
    original = load_file(hf_folder / "model.safetensors")
    assert saved.keys() == original.keys()
    for key, value in original.items():
        np.testing.assert_array_equal(saved[key], value.astype(np.float32), err_msg=key)


def test_a_folder_converted_before_the_projections_were_fused_still_loads(hf_folder, tmp_path):
    """Converted folders written with separate Q, K, V, gate and up weights load into the fused
    layout, value for value."""
    import orbax.checkpoint as ocp

    from focus_jax import checkpoint

    model = focus_jax.load(hf_folder)
    folder = checkpoint.save(model, tmp_path / "converted", source=hf_folder)
    tree = jax.tree.map(np.asarray, nnx.to_pure_dict(model.params))
    attn, mlp = tree["layers"]["attn"], tree["layers"]["mlp"]
    layers, embed, kvh, parts, d = attn["qkv_proj"].shape
    qkv = attn.pop("qkv_proj")
    attn["q_proj"] = qkv[:, :, :, :parts - 2].reshape(layers, embed, kvh * (parts - 2), d)
    attn["k_proj"], attn["v_proj"] = qkv[:, :, :, parts - 2], qkv[:, :, :, parts - 1]
    gate_up = mlp.pop("gate_up_proj")
    mlp["gate_proj"], mlp["up_proj"] = gate_up[:, :, 0], gate_up[:, :, 1]
    shutil.rmtree(folder / "params")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder / "params", tree)
    checkpointer.wait_until_finished()
    assert checkpoint._separate_projections(folder / "params")

    loaded = focus_jax.load(folder)
    for want, got in zip(jax.tree.leaves(model.params), jax.tree.leaves(loaded.params),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


class Killed(BaseException):
    """The process dies here (not an Exception: nothing on the way may handle it)."""


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file()}


def convert_dying_at(boundary: int, monkeypatch, *args, **kwargs) -> bool:
    """``convert``, killed at its ``boundary``-th file boundary: before a file of the folder
    being written, or before a rename of the folder. True if it ran to the end."""
    import os

    seen = [0]

    def crossing(ours: bool) -> None:
        seen[0] += ours
        if ours and seen[0] == boundary:
            raise Killed

    def wrap(write):
        # The files written into the folder being made (orbax writes params/ on its own).
        return lambda self, *a, **k: (crossing(".partial-" in self.parent.name)
                                      or write(self, *a, **k))

    def renaming(src, dst) -> None:
        # The folder's renames: the old one aside, the new one into place.
        crossing(".partial-" in Path(src).name or ".replaced-" in Path(dst).name)
        rename(src, dst)

    rename = os.rename
    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_bytes", wrap(Path.write_bytes))
        patch.setattr(Path, "write_text", wrap(Path.write_text))
        patch.setattr(os, "rename", renaming)
        try:
            focus_jax.convert(*args, **kwargs)
        except Killed:
            return False
    return True


def test_convert_killed_at_any_file_boundary_leaves_nothing_the_old_or_the_new_folder(
        hf_folder, tmp_path, monkeypatch):
    target = tmp_path / "converted"
    new = focus_jax.convert(hf_folder, tmp_path / "new", dtype="bfloat16")

    def beside_params(folder: Path) -> dict[str, bytes]:  # orbax names its files at random
        return {name: data for name, data in snapshot(folder).items()
                if not name.startswith("params/")}

    assert {"tokenizer.json", "chat_template.jinja", "config.json"} <= set(beside_params(new))
    boundary = 1
    while not convert_dying_at(boundary, monkeypatch, hf_folder, target, dtype="float32"):
        assert not target.exists()  # a first conversion: nothing until it is complete
        boundary += 1
    assert boundary > 4  # params, config.json, tokenizer files and the rename were crossed
    old = snapshot(target)
    boundary = 1
    while not convert_dying_at(boundary, monkeypatch, hf_folder, target, dtype="bfloat16",
                               overwrite=True):
        assert not target.exists() or snapshot(target) == old
        boundary += 1
    assert beside_params(target) == beside_params(new) and snapshot(target) != old
    np.testing.assert_array_equal(np.asarray(focus_jax.load(target).logits(tokens(), 4)),
                                  np.asarray(focus_jax.load(new).logits(tokens(), 4)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted", "hf", "new"]


def test_convert_refuses_a_target_that_would_lose_data(hf_folder, tmp_path, capsys):
    from focus_jax.cli import main

    def error(*argv: str) -> str:
        assert main(["convert", *map(str, argv)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        return err

    before = snapshot(hf_folder)
    assert "must lie outside the source" in error(hf_folder, hf_folder)
    assert "must lie outside the source" in error(hf_folder, hf_folder / "converted")
    assert "must lie outside the source" in error(hf_folder, hf_folder.parent, "--overwrite")
    assert snapshot(hf_folder) == before
    file = tmp_path / "file"
    file.write_text("x")
    assert f"{file} is a file" in error(hf_folder, file)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "config.json").write_text("{}")
    assert f"{busy} is not empty" in error(hf_folder, busy)
    (busy / "config.json").unlink()
    (busy / "notes.txt").write_text("mine")
    assert "is not a model folder" in error(hf_folder, busy, "--overwrite")
    assert snapshot(busy) == {"notes.txt": b"mine"}
    (hf_folder / "tokenizer.json").write_text("{ not json")
    assert "tokenizer.json is not valid JSON" in error(hf_folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("folder", ["qwen3_untied", "sdar_moe_tiny", "llada2"])
def test_layouts_converted_on_the_device_equal_those_converted_on_the_host(folder, tmp_path):
    """The loader converts a Hugging Face folder's layouts (transposes, fused Q/K/V and
    gate/up, per-expert stacks, casts) with NumPy on the host or, on accelerators, on the
    device one layer at a time: both give the same parameters, bit for bit (here both on the
    CPU, the device path forced)."""
    from focus_jax.config import ModelConfig
    from focus_jax.models.weights import load_safetensors
    from tests.llada2_checkpoint import write_tiny_llada2

    path = Path(__file__).parent / "fixtures" / "parity" / folder
    if folder == "llada2":
        path = tmp_path / "llada2"
        write_tiny_llada2(path, seed=0)
    cfg = ModelConfig.from_file(path / "config.json", dtype="bfloat16")
    host = nnx.state(load_safetensors(path, cfg, on_device=False))
    device = nnx.state(load_safetensors(path, cfg, on_device=True))
    host_leaves = jax.tree_util.tree_leaves_with_path(host)
    device_leaves = jax.tree.leaves(device)
    assert len(host_leaves) == len(device_leaves) > 5
    for (where, a), b in zip(host_leaves, device_leaves, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(where))
