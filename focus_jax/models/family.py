"""What a model family provides: its ``config.json`` reader and writer, its checkpoints' key
table and its named geometries (presets for benchmarks with random weights)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from focus_jax.config import ModelConfig
from focus_jax.models.weights import KeyTable


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: the ``model_type`` values it reads, and how."""

    name: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any], str], ModelConfig]
    """``(config.json dictionary, dtype) -> ModelConfig``; a clear error for what it cannot
    run, naming the field."""
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    key_table: KeyTable
    geometries: dict[str, dict[str, Any]]
    """Named geometries: ``ModelConfig`` fields (``moe`` a dictionary of ``MoEConfig``
    fields)."""
    default_mask_token_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    """``model_type`` -> the mask token of its public checkpoints, where neither
    ``config.json`` nor the tokenizer names one."""
