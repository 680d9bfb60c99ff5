"""Loading models from local folders, and converting Hugging Face checkpoints to orbax.

Two folder layouts load:

* a Hugging Face folder: ``config.json``, ``*.safetensors`` (single, or sharded with
  ``model.safetensors.index.json``), tokenizer files;
* a converted folder (``focus-jax convert``): ``config.json``, ``params/`` (an orbax checkpoint,
  faster to restore and shardable on restore), tokenizer files.

Nothing is downloaded: paths only. A folder is written whole or not at all: into a temporary
sibling folder, flushed to disk, then renamed into place (``replacing``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from focus_jax import sharding
from focus_jax.config import ConfigError, ModelConfig, Quantization
from focus_jax.model import Model
from focus_jax.models import family
from focus_jax.models.qwen3.params import fuse_separate_projections, has_separate_projections
from focus_jax.models.weights import abstract_decoder, load_safetensors, not_utf8, read_json
from focus_jax.quant import as_quantization, check_platform
from focus_jax.quant import quantize as quantize_model

PARAMS_DIR = "params"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja", "added_tokens.json")
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                   "special_tokens_map.json", "added_tokens.json")


def load(path: str | Path, *, dtype: str | None = None, tokenizer: bool = True,
         mesh: Mesh | None = None, quantize: str | Quantization | None = None) -> Model:
    """Load a model folder (Hugging Face or converted).

    ``dtype``: ``"bfloat16"`` or ``"float32"`` (default: the checkpoint's). ``tokenizer=False``
    loads the weights alone (prompts must then be token ids). ``mesh``: shard the parameters
    over a ``("data", "model")`` mesh, each tensor restored (converted folder) or read (Hugging
    Face folder) straight into its shards: no device holds a whole tensor it does not own.
    ``quantize``: ``"int8"`` or ``"fp8"`` weights (per output channel), or a
    :class:`~focus_jax.config.Quantization` (8-bit activations too), docs/quantization.md; a
    folder converted with ``--quantize`` loads quantized without it.

    The same as :func:`load_weights` of :func:`describe`: a caller can compile programs for
    the described model while its weights load (``focus-jax serve`` does). The tokenizer loads
    beside the weights (:class:`TokenizerLoad`).
    """
    _check_quantization(quantize, mesh)
    pending = TokenizerLoad(path) if tokenizer else None
    return load_weights(describe(path, dtype=dtype, tokenizer=pending or False, mesh=mesh), path,
                        mesh=mesh, quantize=quantize, tokenizer=pending)


def _check_quantization(quantize: str | Quantization | None, mesh: Mesh | None
                        ) -> Quantization | None:
    quantization = as_quantization(quantize)
    if mesh is not None:
        check_platform(quantization, mesh.devices.flat[0].platform, mesh.devices.flat[0])
    else:
        check_platform(quantization, jax.default_backend())
    return quantization


def describe(path: str | Path, *, dtype: str | None = None,
             tokenizer: bool | TokenizerLoad = True, mesh: Mesh | None = None) -> Model:
    """The folder's model with its weights' shapes only (nothing read but config.json and the
    tokenizer, nothing allocated): an engine of it compiles the programs that the loaded
    model's engine then finds compiled (the weights load as unquantized, unsharded arrays of
    exactly these shapes). The folder is checked as :func:`load` checks it.

    ``tokenizer``: load it (``True``), or not; or a :class:`TokenizerLoad` of the folder, still
    loading: the model is then described without its tokenizer (only the mask token's id is
    needed, read from the tokenizer's files where they name it), and :func:`load_weights` with
    the same ``tokenizer`` adds it."""
    folder = _model_folder(path)
    try:
        cfg = ModelConfig.from_file(folder / "config.json", dtype=dtype)
    except UnicodeDecodeError as err:
        raise not_utf8(folder / "config.json", err) from None
    pending = tokenizer if isinstance(tokenizer, TokenizerLoad) else None
    tok = load_tokenizer(folder) if tokenizer is True else None
    if cfg.mask_token_id is None:
        mask = pending.mask_token_id() if pending else getattr(tok, "mask_token_id", None)
        default = family(cfg.model_type).default_mask_token_ids.get(cfg.model_type)
        if mask is None and default is not None and cfg.vocab_size > default:
            mask = default
        cfg = cfg.replace(mask_token_id=mask)
    if mesh is not None:
        sharding.check_divisible(cfg, mesh)
    return Model.from_decoder(abstract_decoder(cfg), tok, stop_token_ids(folder, tok))


def load_weights(described: Model, path: str | Path, *, mesh: Mesh | None = None,
                 quantize: str | Quantization | None = None,
                 tokenizer: TokenizerLoad | None = None) -> Model:
    """``described`` (:func:`describe` of the folder ``path``) with the folder's weights, and
    with the tokenizer of ``tokenizer`` (waited for once the weights are in) where given."""
    quantization = _check_quantization(quantize, mesh)
    folder, cfg = Path(path).expanduser(), described.config
    if (folder / PARAMS_DIR).is_dir():
        decoder = _restore_orbax(folder / PARAMS_DIR, cfg, mesh)
    elif cfg.quantization is not None:
        raise ConfigError(f"{folder}/config.json has focus_jax's quantization_config but the "
                          f"folder has no {PARAMS_DIR}/ (quantized weights are saved by "
                          f"focus-jax convert --quantize)")
    else:
        decoder = load_safetensors(folder, cfg, mesh)
    if tokenizer is not None:
        tok = tokenizer.result()
        model = Model.from_decoder(decoder, tok, stop_token_ids(folder, tok))
        tokenizer.check_mask(model.config)
    else:
        model = Model.from_decoder(decoder, described.tokenizer, described.stop_token_ids)
    return model if quantization is None else quantize_model(model, quantization, mesh)


def _model_folder(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ConfigError(f"model folder {folder} does not exist (focus_jax loads local paths "
                          f"only: download the checkpoint first, see checkpoints/README.md)")
    if not folder.is_dir():
        raise ConfigError(f"{folder} is a file; give the folder that holds config.json")
    return folder


class TokenizerLoad:
    """A model folder's tokenizer, loading on a thread of its own from construction on.

    transformers' tokenizer classes import torch wherever it is installed: about 10 s of a
    GPU machine's start (docs/startup.md), which the weights' load and the programs' compile
    need not wait for. Only the mask token's id enters a compiled program, and
    :meth:`mask_token_id` reads it from the tokenizer's files where they name it. Raises
    :class:`ConfigError` at once when the folder has no tokenizer; the load's own error is
    raised by :meth:`result`."""

    def __init__(self, path: str | Path):
        self.folder = _model_folder(path)
        _require_tokenizer(self.folder)
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._mask_from_files: int | None = None  # set by mask_token_id(), checked on arrival
        # A daemon: a process that ends early (a bad option) does not wait for the import.
        threading.Thread(target=self._load, name="focus-jax-tokenizer", daemon=True).start()

    def _load(self) -> None:
        try:
            self._value = load_tokenizer(self.folder)
        except BaseException as err:  # raised again in the caller's thread by result()
            self._error = err
        finally:
            self._done.set()

    def result(self) -> Any:
        """The tokenizer, once loaded."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def mask_token_id(self) -> int | None:
        """The mask token's id: from the tokenizer's files where they name it, without waiting
        for the load; otherwise the loaded tokenizer's (``None`` where it has none)."""
        self._mask_from_files = mask_token_id_from_files(self.folder)
        if self._mask_from_files is not None:
            return self._mask_from_files
        return getattr(self.result(), "mask_token_id", None)

    def check_mask(self, config: ModelConfig) -> None:
        """The loaded tokenizer gives the mask id that its files gave (a check of
        :func:`mask_token_id_from_files`: the programs were compiled with it)."""
        if self._mask_from_files is None or config.mask_token_id != self._mask_from_files:
            return
        loaded = getattr(self.result(), "mask_token_id", None)
        if loaded is not None and loaded != self._mask_from_files:
            raise ConfigError(f"the tokenizer in {self.folder} gives mask token id {loaded}, its "
                              f"files {self._mask_from_files}; set mask_token_id in config.json")


def mask_token_id_from_files(folder: Path) -> int | None:
    """The id of the mask token that ``tokenizer_config.json`` names (``mask_token``), looked up
    in its ``added_tokens_decoder`` or in ``tokenizer.json``'s ``added_tokens``; ``None`` where
    the files do not say (the loaded tokenizer then decides)."""
    config_file = folder / "tokenizer_config.json"
    config = read_json(config_file) if config_file.exists() else {}
    mask = config.get("mask_token") if isinstance(config, dict) else None
    if isinstance(mask, dict):
        mask = mask.get("content")
    if not isinstance(mask, str) or not mask:
        return None
    added = config.get("added_tokens_decoder")
    entries = ([{"id": key, **entry} for key, entry in added.items() if isinstance(entry, dict)]
               if isinstance(added, dict) else [])
    if not entries and (folder / "tokenizer.json").exists():
        content = read_json(folder / "tokenizer.json")
        if isinstance(content, dict) and isinstance(content.get("added_tokens"), list):
            entries = content["added_tokens"]
    ids = {str(e.get("id")) for e in entries if isinstance(e, dict) and e.get("content") == mask}
    if len(ids) != 1:
        return None
    (token,) = ids
    return int(token) if token.isdigit() else None


def _require_tokenizer(folder: Path) -> None:
    if not has_tokenizer(folder):
        raise ConfigError(f"{folder} holds no tokenizer (tokenizer.json / tokenizer_config.json); "
                          f"copy the tokenizer files next to config.json, or load with "
                          f"tokenizer=False and pass token ids")


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json",
                                                      "vocab.json"))


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer (``transformers``), or a clear error when it has none, when a file
    of it is not JSON, or when ``tokenizer_config.json`` names a file the folder lacks."""
    _require_tokenizer(folder)
    config_file = folder / "tokenizer_config.json"
    if config_file.exists():
        _check_named_files(config_file, read_json(config_file))
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        try:
            # fix_mistral_regex: transformers takes a folder whose config.json lacks
            # transformers_version (SDAR's) for a Mistral one, warns that its regex is wrong and
            # advises a Mistral pattern, which would break Qwen2 tokenization (docs/startup.md).
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                 fix_mistral_regex=False)
        except (ValueError, OSError, KeyError):
            # AutoTokenizer reads config.json's model_type, which transformers may not know (sdar).
            if not (folder / "tokenizer.json").exists():
                raise
            return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    except Exception as err:  # the tokenizers library raises bare Exceptions for a corrupt file
        for name in _TOKENIZER_JSON:
            if (folder / name).exists():
                read_json(folder / name)  # names the file that is not UTF-8 JSON
        reason = (str(err).splitlines() or [""])[0]
        raise ConfigError(f"the tokenizer in {folder} does not load ({type(err).__name__}: "
                          f"{reason}); re-download or re-convert the checkpoint") from None


def _check_named_files(config_file: Path, config: Any) -> None:
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file} must hold a JSON object, found {type(config).__name__}")
    # vocab_file, merges_file, tokenizer_file, ...: bare names are files of this folder (a
    # path is where the author's copy lay, which transformers ignores).
    named = [value for key, value in config.items() if key.endswith("_file")
             and isinstance(value, str) and value and Path(value).name == value]
    missing = [name for name in named if not (config_file.parent / name).exists()]
    if missing:
        raise ConfigError(f"{config_file} names {', '.join(missing)}, which the folder lacks; "
                          f"copy it from the original checkpoint")


def stop_token_ids(folder: Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` and the tokenizer."""
    ids: list[int] = []
    generation = folder / "generation_config.json"
    if generation.exists():
        content = read_json(generation)
        eos = content.get("eos_token_id") if isinstance(content, dict) else None
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not isinstance(content, dict) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in eos):
            raise ConfigError(f"{generation} must be a JSON object whose eos_token_id is a token "
                              f"id or a list of them")
        ids += eos
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.append(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _separate_projections(params_dir: Path) -> bool:
    """The orbax checkpoint holds the fused weights' parts as separate weights (folders
    converted before Q, K, V and the MLP's gate and up were fused)."""
    tree = ocp.StandardCheckpointer().metadata(params_dir.resolve()).item_metadata
    try:
        return has_separate_projections(tree["layers"])
    except (KeyError, TypeError):
        return False


def _restore_orbax(params_dir: Path, cfg: ModelConfig, mesh: Mesh | None = None) -> Any:
    graphdef, abstract = nnx.split(abstract_decoder(cfg))
    if mesh is None:
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(abstract))
    else:
        shardings = nnx.to_pure_dict(sharding.param_shardings(abstract, mesh))
        target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                              nnx.to_pure_dict(abstract), shardings)
    try:
        if _separate_projections(params_dir):
            restored = ocp.StandardCheckpointer().restore(params_dir.resolve())
            fuse_separate_projections(restored["layers"], cfg)
            restored = jax.device_put(restored, jax.tree.map(lambda t: t.sharding, target))
        else:
            restored = ocp.StandardCheckpointer().restore(params_dir.resolve(), target)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"the orbax checkpoint in {params_dir} does not match config.json "
                          f"({str(err).splitlines()[0]})") from None
    nnx.replace_by_pure_dict(abstract, restored)
    return nnx.merge(graphdef, abstract)


def check_target(target: Path, overwrite: bool = False) -> None:
    """``target`` can receive a model folder: it is absent or an empty folder, or, with
    ``overwrite``, a model folder (one with config.json) to replace."""
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target} is a file; give the path of a folder to write")
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"{target} is not empty; give a new or empty folder, or --overwrite "
                          f"to replace the model folder there")
    if not (target / "config.json").exists():
        raise ConfigError(f"{target} is not a model folder (it has no config.json); --overwrite "
                          f"replaces model folders only: give a new or empty folder")


@contextlib.contextmanager
def replacing(target: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """A fresh folder to fill, which becomes ``target`` once the block ends without an error.

    The folder is a hidden sibling of ``target``; at the end every file in it is flushed to disk
    and it is renamed into place, so that ``target`` is never a half-written folder. An old
    folder at ``target`` (``overwrite``, see :func:`check_target`) is kept until the new one is
    complete. A process killed between the two renames leaves ``target`` absent and the old
    folder beside it as ``.NAME.replaced-*``.
    """
    target = Path(target).expanduser().resolve()
    check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    suffix = f"{os.getpid()}-{secrets.token_hex(4)}"
    staging = target.with_name(f".{target.name}.partial-{suffix}")
    staging.mkdir()
    try:
        yield staging
        _flush_tree(staging)
        if target.exists():
            retired = target.with_name(f".{target.name}.replaced-{suffix}")
            os.rename(target, retired)
            try:
                os.rename(staging, target)
            except BaseException:
                os.rename(retired, target)
                raise
            _flush(target.parent)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, target)
            _flush(target.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _flush(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _flush_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _flush(Path(root) / name)
        _flush(Path(root))


def save(model: Model, out: str | Path, *, source: Path | None = None,
         overwrite: bool = False) -> Path:
    """Write a converted folder: ``config.json``, ``params/`` (orbax), tokenizer files and
    ``generation_config.json``, whole or not at all (:func:`replacing`; ``overwrite`` replaces a
    model folder at ``out``). The tokenizer and generation files are copied from ``source`` when
    given, else written from the model."""
    target = Path(out).expanduser().resolve()
    with replacing(target, overwrite=overwrite) as folder:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(folder / PARAMS_DIR, nnx.to_pure_dict(model.params))
        checkpointer.wait_until_finished()
        (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
        if source is not None:
            for name in (*TOKENIZER_FILES, "generation_config.json"):
                if (source / name).exists():
                    (folder / name).write_bytes((source / name).read_bytes())
        else:
            if model.tokenizer is not None:
                model.tokenizer.save_pretrained(str(folder))
            if model.stop_token_ids:
                (folder / "generation_config.json").write_text(
                    json.dumps({"eos_token_id": list(model.stop_token_ids)}) + "\n")
    return target


def convert(hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None,
            overwrite: bool = False, quantize: str | None = None) -> Path:
    """Convert a Hugging Face folder into a converted (orbax) folder at ``out_dir``, which must
    be new or empty, or with ``overwrite`` a model folder to replace (see :func:`save`), and lie
    outside the source (nor hold it). ``quantize``: ``"int8"`` or ``"fp8"`` weights, saved
    quantized (their scales beside them)."""
    source, target = Path(hf_dir).expanduser(), Path(out_dir).expanduser()
    inside = source.resolve() == target.resolve() or source.resolve() in target.resolve().parents
    if inside or target.resolve() in source.resolve().parents:
        raise ConfigError(f"cannot convert {source} into {target}: the target must lie outside "
                          f"the source folder and must not contain it")
    check_target(target.resolve(), overwrite)  # before the loading, which takes a while
    # The tokenizer is loaded to check it: a folder converted from a broken one would not load.
    model = load(source, dtype=dtype, tokenizer=has_tokenizer(source), quantize=quantize)
    return save(model, target, source=source, overwrite=overwrite)
