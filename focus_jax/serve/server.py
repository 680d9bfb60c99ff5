"""Running the application with uvicorn, and shutting it down on SIGTERM or SIGINT.

On the first signal the engine lets running requests finish within the grace period and aborts
the rest (their clients get an error event or a 503); meanwhile the server still answers, so
that probes see ``/health`` turn 503 (not a refused connection) and new requests get a 503.
Once the engine has drained, uvicorn stops listening, and the process exits normally (status 0).
A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SHUTDOWN_MARGIN_SECONDS = 5.0
"""uvicorn's own limit on waiting for connections after the engine's grace period: a backstop."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose signals begin the engine's graceful shutdown (uvicorn alone would
    wait for connections without ending their requests, and re-raise the signal at exit)."""

    def __init__(self, app: FastAPI, host: str, port: int, log_level: str = "info"):
        state = app.state.serving
        super().__init__(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="on",
            timeout_graceful_shutdown=state.settings.grace_seconds + _SHUTDOWN_MARGIN_SECONDS))
        self.state = state
        self._drain: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # off the main thread (an embedded server): stopped through should_exit
            return
        loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            loop.add_signal_handler(sig, self.begin_shutdown)
        try:
            yield
        finally:
            for sig in _SIGNALS:
                loop.remove_signal_handler(sig)

    def begin_shutdown(self) -> None:
        """Stop accepting and let the engine drain (called on the server's event loop)."""
        if self._drain is not None:
            self.force_exit = True
            return
        log.info("shutting down: running requests have %.0f s to finish",
                 self.state.settings.grace_seconds)
        self.state.draining = True
        self._drain = asyncio.get_running_loop().create_task(
            self.state.engine.shutdown(self.state.settings.grace_seconds))
        # Listening until the drain ends: /health answers 503 meanwhile.
        self._drain.add_done_callback(lambda _: setattr(self, "should_exit", True))


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free port), to be served by :func:`serve`.
    Binding first lets a taken port fail before the (long) warm-up."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    """Serve ``app`` on ``sock`` until SIGTERM or SIGINT; returns once every request has ended."""
    host, port = sock.getsockname()[:2]
    DrainingServer(app, host, port, log_level).run(sockets=[sock])
