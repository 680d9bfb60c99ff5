"""Loading models from local folders, and converting Hugging Face checkpoints to orbax.

Two folder layouts load:

* a Hugging Face folder: ``config.json``, ``*.safetensors`` (single, or sharded with
  ``model.safetensors.index.json``), tokenizer files;
* a converted folder (``focus-jax convert``): ``config.json``, ``params/`` (an orbax checkpoint,
  faster to restore and shardable on restore), tokenizer files.

Nothing is downloaded: paths only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from focus_jax import sharding
from focus_jax.config import ConfigError, ModelConfig
from focus_jax.model import Model
from focus_jax.models.params import abstract_decoder, load_safetensors

PARAMS_DIR = "params"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja", "added_tokens.json")
SDAR_MASK_TOKEN_ID = 151669


def load(path: str | Path, *, dtype: str | None = None, tokenizer: bool = True,
         mesh: Mesh | None = None) -> Model:
    """Load a model folder (Hugging Face or converted).

    ``dtype``: ``"bfloat16"`` or ``"float32"`` (default: the checkpoint's). ``tokenizer=False``
    loads the weights alone (prompts must then be token ids). ``mesh``: shard the parameters
    over a ``("data", "model")`` mesh (a converted folder restores straight into the shards).
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ConfigError(f"model folder {folder} does not exist (focus_jax loads local paths "
                          f"only: download the checkpoint first, see checkpoints/README.md)")
    if not folder.is_dir():
        raise ConfigError(f"{folder} is a file; give the folder that holds config.json")
    cfg = ModelConfig.from_file(folder / "config.json", dtype=dtype)
    tok = load_tokenizer(folder) if tokenizer else None
    if cfg.mask_token_id is None:
        mask = getattr(tok, "mask_token_id", None)
        if mask is None and cfg.model_type == "sdar" and cfg.vocab_size > SDAR_MASK_TOKEN_ID:
            mask = SDAR_MASK_TOKEN_ID
        cfg = cfg.replace(mask_token_id=mask)
    if mesh is not None:
        sharding.check_divisible(cfg, mesh)
    if (folder / PARAMS_DIR).is_dir():
        decoder = _restore_orbax(folder / PARAMS_DIR, cfg, mesh)
    else:
        decoder = load_safetensors(folder, cfg)
    model = Model.from_decoder(decoder, tok, stop_token_ids(folder, tok))
    if mesh is not None:
        model.params = sharding.shard_params(model.params, mesh)
    return model


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer (``transformers``), or a clear error when it has none."""
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json",
                                                      "vocab.json")):
        raise ConfigError(f"{folder} holds no tokenizer (tokenizer.json / tokenizer_config.json); "
                          f"copy the tokenizer files next to config.json, or load with "
                          f"tokenizer=False and pass token ids")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, OSError, KeyError):
        # AutoTokenizer reads config.json's model_type, which transformers may not know (sdar).
        if (folder / "tokenizer.json").exists():
            return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        raise


def stop_token_ids(folder: Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` and the tokenizer."""
    ids: list[int] = []
    generation = folder / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.append(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))


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
        restored = ocp.StandardCheckpointer().restore(params_dir.resolve(), target)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"the orbax checkpoint in {params_dir} does not match config.json "
                          f"({str(err).splitlines()[0]})") from None
    nnx.replace_by_pure_dict(abstract, restored)
    return nnx.merge(graphdef, abstract)


def save(model: Model, out: str | Path, *, source: Path | None = None) -> Path:
    """Write a converted folder: ``config.json``, ``params/`` (orbax) and tokenizer files."""
    out = Path(out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (out / PARAMS_DIR).exists():
        shutil.rmtree(out / PARAMS_DIR)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / PARAMS_DIR, nnx.to_pure_dict(model.params))
    checkpointer.wait_until_finished()
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    if source is not None:
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (source / name).exists():
                shutil.copy2(source / name, out / name)
    elif model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(out))
    return out


def convert(hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None) -> Path:
    """Convert a Hugging Face folder into a converted (orbax) folder."""
    source = Path(hf_dir).expanduser()
    model = load(source, dtype=dtype, tokenizer=False)
    return save(model, out_dir, source=source)
