"""The bundled model, shipped inside the package (``focus-tiny``: 12.7M parameters, block size 32,
trained by ``scripts/train_bundled.py``): package data of every install, editable or not, so
``focus-jax demo`` answers after a plain ``pip install``. The repository's
``checkpoints/focus-tiny`` is a link to it."""

from pathlib import Path

MODEL = Path(__file__).resolve().parent / "focus-tiny"
"""The bundled model's folder (a Hugging Face style folder: config, safetensors, tokenizer)."""
