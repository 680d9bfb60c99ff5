"""Server-sent events as OpenAI streams them: ``data: {json}`` per event, ``data: [DONE]`` last."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """An SSE response that closes its event generator when it ends, however it ends: a client
    that disconnects mid-stream has its request aborted at once, not when the generator is
    garbage-collected."""

    def __init__(self, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
