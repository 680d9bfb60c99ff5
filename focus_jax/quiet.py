"""Messages of dependencies that do not apply to focus_jax, dropped one by one (each by its
logger and its first words; everything else those loggers say still shows)."""

from __future__ import annotations

import logging

TRANSFORMERS_NOISE = {
    # At import without PyTorch: focus_jax uses transformers for tokenizers and configs only.
    "transformers": ("PyTorch was not found.",),
    # AutoTokenizer reading the config.json of a family transformers does not know (SDAR,
    # SDAR-MoE, LLaDA2): only the tokenizer is loaded from it.
    "transformers.configuration_utils": tuple(
        f"You are using a model of type `{model_type}` to instantiate a model of type ``."
        for model_type in ("sdar", "sdar_moe", "llada2_moe")),
}
"""Messages by the logger that logs them (a filter sees only its own logger's records)."""


class DropMessages(logging.Filter):
    """Drops the records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_transformers() -> None:
    """Drop :data:`TRANSFORMERS_NOISE` from transformers' log (before it is imported: the first
    is logged at import). Once per process."""
    for name, starts in TRANSFORMERS_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(starts))
