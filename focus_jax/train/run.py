"""A training run's folder: what the run is (``run.json``) and its loss log.

A run is fixed by what determines its weights: the options that shape the trajectory, the data
and the initial model. ``run.json`` records them when the run starts; training into the folder
again resumes the run only if they are the same, so that a changed option, data file or model
is never silently trained for zero steps or mixed into another run's checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from focus_jax.config import ConfigError
from focus_jax.models.weights import read_json

RUN_FILE = "run.json"
LOG_FILE = "log.jsonl"
STATE_DIR = "train_state"
MODEL_DIR = "model"
_ENTRIES = (RUN_FILE, LOG_FILE, STATE_DIR, MODEL_DIR)


def weights_digest(params: nnx.State) -> str:
    """A hash of every parameter's name, dtype, shape and bytes (read to the host one at a time)."""
    digest = hashlib.blake2b(digest_size=16)
    for path, leaf in jax.tree.flatten_with_path(nnx.to_pure_dict(params))[0]:
        value = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{jax.tree_util.keystr(path)} {value.dtype} {value.shape}".encode())
        digest.update(value.reshape(-1).view(np.uint8))
    return digest.hexdigest()


def as_stored(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as ``run.json`` stores it (JSON's types: a tuple reads back as a list)."""
    return json.loads(json.dumps(record))


def check_folder(out: Path) -> None:
    """``out`` can hold a run: it is absent, empty, or holds a run (``run.json``). Cheap, so that
    callers can check before loading a model."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; give a folder for the run")
    if out.is_dir() and any(out.iterdir()) and not (out / RUN_FILE).exists():
        raise ConfigError(f"{out} is not empty and holds no training run ({RUN_FILE}); give a new "
                          f"or empty folder")


def difference(stored: dict[str, Any], given: dict[str, Any]) -> str | None:
    """The first thing that differs between two runs, in words; None for the same run."""
    keys = ["model_weights", "model_config", "data",
            *sorted((set(stored) | set(given)) - {"model_weights", "model_config", "data"})]
    for key in keys:
        old, new = stored.get(key), given.get(key)
        if old == new:
            continue
        if key == "model_weights":
            return "another initial model (its weights differ)"
        if key == "model_config":
            old, new = old or {}, new or {}
            field = next(k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))
            return (f"another initial model (config.json {field} {old.get(field)!r}, "
                    f"now {new.get(field)!r})")
        if key == "data":
            return f"other data (the run's is {old}, now {new})"
        return f"{key} {old!r} (now {new!r})"
    return None


def prepare(out: Path, record: dict[str, Any], overwrite: bool = False) -> None:
    """Make ``out`` the folder of the run ``record`` describes.

    A new or empty folder gets ``run.json``; a folder of the same run is left as it is (to
    resume); a folder of another run is a ``ConfigError`` naming the difference, unless
    ``overwrite``, which removes that run's files and starts this one.
    """
    check_folder(out)
    record = as_stored(record)
    stored_file = out / RUN_FILE
    if stored_file.exists():
        change = difference(read_json(stored_file), record)
        if change is None:
            return
        if not overwrite:
            raise ConfigError(f"{out} holds another run, with {change}; give the same model, data "
                              f"and options to resume it, or --overwrite to start over")
        for name in _ENTRIES:
            entry = out / name
            if entry.is_dir():
                shutil.rmtree(entry)
            elif entry.exists():
                entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    _replace_text(stored_file, json.dumps(record, indent=1) + "\n")


def keep_log_until(path: Path, step: int) -> None:
    """Drop the log's records after ``step`` (a resumed run trains those steps again) and a torn
    last line, so that no step appears twice."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().split("\n"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    _replace_text(path, "".join(kept))


def _replace_text(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    with partial.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
