"""An OpenAI-compatible HTTP server over the engine (``focus-jax serve``), and a load client
to measure one (``python -m focus_jax.serve.load``)."""

from focus_jax.serve.app import create_app
from focus_jax.serve.server import DrainingServer, listen_socket, serve
from focus_jax.serve.state import ServeSettings

__all__ = ["DrainingServer", "ServeSettings", "create_app", "listen_socket", "serve"]
