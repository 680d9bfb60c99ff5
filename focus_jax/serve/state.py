"""What the endpoints share: the engine, the metrics, the settings, and whether the server is
shutting down."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from focus_jax.engine import AsyncEngine
from focus_jax.model import Model
from focus_jax.serve.errors import APIError
from focus_jax.serve.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 1 << 20
"""Request bodies above this are refused (413): the longest context's prompt as token ids is a
few hundred KiB of JSON."""


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """How the server behaves (the engine's own configuration is the engine's)."""

    model_name: str
    """The name clients use (``model`` in requests, ``/v1/models``)."""
    api_key: str | None = None
    """When set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    grace_seconds: float = 30.0
    """On shutdown, how long running requests may take to finish before they are aborted."""

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("the served model needs a name")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine
    settings: ServeSettings
    metrics: ServerMetrics
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    draining: bool = False
    """Set when the server begins to shut down: /health answers 503."""

    @property
    def model(self) -> Model:
        return self.engine.engine.model

    @property
    def context(self) -> int:
        """Prompt plus generated tokens a request may have: the engine's cache positions, at most
        the model's trained positions."""
        return min(self.engine.engine.cache_len, self.model.config.max_position_embeddings)

    @contextlib.contextmanager
    def counting_refusals(self) -> Iterator[None]:
        """Count an :class:`APIError` raised in the block as a request refused as invalid."""
        try:
            yield
        except APIError:
            self.metrics.refused("invalid")
            raise

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is the served model's (no name: the served model)."""
        if name is not None and name != self.settings.model_name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves "
                                f"{self.settings.model_name!r}", param="model",
                           code="model_not_found")

    def model_card(self) -> dict[str, Any]:
        return {"id": self.settings.model_name, "object": "model", "created": self.created,
                "owned_by": "focus-jax", "max_model_len": self.context}
