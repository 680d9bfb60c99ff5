"""The ASGI application: the endpoints behind an API-key check and a body-size limit, every error
answered with an OpenAI-style body."""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from focus_jax.compilation import count_compilations
from focus_jax.engine import AsyncEngine
from focus_jax.serve import routes
from focus_jax.serve.errors import APIError, install_handlers
from focus_jax.serve.metrics import ServerMetrics
from focus_jax.serve.state import ServerState, ServeSettings


def create_app(engine: AsyncEngine, settings: ServeSettings) -> FastAPI:
    """The server's application over a running ``engine`` (warmed up: serving never compiles).
    Shutting the application down shuts the engine down (``settings.grace_seconds``)."""
    if engine.engine.model.tokenizer is None:
        raise ValueError("the server needs the model's tokenizer: load the model with it")
    state = ServerState(engine, settings, ServerMetrics(engine))

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        with count_compilations() as compiled:
            state.metrics.compilations = compiled
            yield
        state.draining = True
        await engine.shutdown(settings.grace_seconds)

    app = FastAPI(title="focus-jax", summary="OpenAI-compatible block-diffusion serving",
                  lifespan=lifespan)
    app.state.serving = state
    install_handlers(app)
    app.include_router(routes.router)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(RequireKey, key=settings.api_key)  # outermost: checked first
    return app


class RequireKey:
    """401 for ``/v1/*`` requests without ``Authorization: Bearer <key>`` (compared in constant
    time). ``/health`` and ``/metrics`` stay open for probes and scrapers."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                message = ("missing API key: send the header 'Authorization: Bearer KEY'"
                           if given is None else "incorrect API key")
                error = APIError(401, message, code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for request bodies over ``limit`` bytes. The body is read here (at most ``limit``
    bytes kept) and replayed to the app; later ``receive`` calls (disconnect) pass through.
    (Starlette's own limit answers in plain text on some paths; clients expect an error body.)"""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body arrived
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._too_large(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body exceeds {self.limit} bytes",
                         code="request_too_large")
        await error.response()(scope, receive, send)
