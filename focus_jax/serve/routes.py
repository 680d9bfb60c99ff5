"""The endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from focus_jax.engine import RequestError
from focus_jax.serve import sse
from focus_jax.serve.errors import internal, invalid
from focus_jax.serve.generation import ClientGone, Generation, Piece, unless_disconnected
from focus_jax.serve.prompts import chat_prompt_ids, completion_prompt_ids
from focus_jax.serve.schemas import ChatCompletionRequest, CompletionRequest, RequestBody
from focus_jax.serve.state import ServerState

log = logging.getLogger(__name__)
router = APIRouter()

CLIENT_CLOSED = 499
"""The status logged for a request whose client left before its answer (nobody receives it)."""


def _state(request: Request) -> ServerState:
    return request.app.state.serving


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while serving; 503 while shutting down (or if the engine's loop has stopped)."""
    state = _state(request)
    if state.draining or not state.engine.running:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_state(request).model_card()]}


@router.get("/v1/models/{name:path}")
async def model(name: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(name)
    return state.model_card()


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    with state.counting_refusals():
        _check(state, body)
        generation = _generation(state, body, completion_prompt_ids(state.model, body.prompt),
                                 prompt_param="prompt")
    return await _answer(request, state, body, generation, _COMPLETION)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    with state.counting_refusals():
        _check(state, body)
        generation = _generation(state, body, chat_prompt_ids(state.model, body.chat_messages()),
                                 prompt_param="messages")
    return await _answer(request, state, body, generation, _CHAT)


def _check(state: ServerState, body: RequestBody) -> None:
    body.reject_unsupported()
    state.check_model(body.model)


def _generation(state: ServerState, body: RequestBody, ids: list[int], prompt_param: str) -> Generation:
    """The request, checked against the context, ready to start."""
    try:
        params = body.sampling_params(_max_new_tokens(state, body, len(ids), prompt_param))
    except RequestError as err:
        raise invalid(str(err)) from None
    return Generation(state.engine, state.metrics, state.model.tokenizer, ids, params, body.stop)


def _max_new_tokens(state: ServerState, body: RequestBody, prompt_len: int, prompt_param: str) -> int:
    """The request's token limit: what it asked for, or the rest of the context."""
    context = state.context
    if prompt_len >= context:
        raise invalid(f"the prompt has {prompt_len} tokens, but this server's context holds "
                      f"{context}: shorten it", param=prompt_param, code="context_length_exceeded")
    wanted = body.requested_tokens
    if wanted is None:
        return context - prompt_len
    if prompt_len + wanted > context:
        raise invalid(f"the prompt's {prompt_len} tokens plus max_tokens={wanted} exceed this "
                      f"server's context of {context} tokens: lower max_tokens or shorten the prompt",
                      param="max_tokens", code="context_length_exceeded")
    return wanted


class _Shape:
    """How one endpoint's answers look."""

    def __init__(self, kind: str, id_prefix: str, chat: bool):
        self.kind, self.id_prefix, self.chat = kind, id_prefix, chat

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        key, value = (("message", {"role": "assistant", "content": text}) if self.chat
                      else ("text", text))
        return {"index": 0, key: value, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
        if not self.chat:
            return self.choice(text, finish_reason)
        delta = ({"role": "assistant", "content": text} if first
                 else {"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


_COMPLETION = _Shape("text_completion", "cmpl", chat=False)
_CHAT = _Shape("chat.completion", "chatcmpl", chat=True)


async def _answer(request: Request, state: ServerState, body: RequestBody, generation: Generation,
                  shape: _Shape) -> Response:
    header = {"id": f"{shape.id_prefix}-{uuid.uuid4().hex}", "object": shape.kind,
              "created": int(time.time()), "model": state.settings.model_name}
    try:
        if body.stream:
            await unless_disconnected(request.receive, generation.start())
            return sse.EventStream(_events(generation, shape, header, body.include_usage))
        text, last = await unless_disconnected(request.receive, _complete(generation))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if last.error is not None:
        raise last.error
    return JSONResponse({**header, "choices": [shape.choice(text, last.finish_reason)],
                         "usage": last.usage})


async def _complete(generation: Generation) -> tuple[str, Piece]:
    await generation.start()
    return await generation.complete()


async def _events(generation: Generation, shape: _Shape, header: dict[str, Any],
                  include_usage: bool) -> AsyncIterator[str]:
    """A chunk per committed block (text held back while it may begin a stop string); the last
    content chunk has the finish reason, then the usage chunk (if asked) and ``[DONE]``. A request
    that ends without finishing ends with an error event."""
    header = {**header, "object": f"{shape.kind}.chunk" if shape.chat else shape.kind}
    first = True
    try:
        async with contextlib.aclosing(generation.pieces()) as pieces:
            async for piece in pieces:
                if piece.error is not None:
                    yield sse.event(piece.error.body())
                    break
                if piece.text or piece.finish_reason:
                    chunk = {**header, "choices": [shape.chunk_choice(piece.text, piece.finish_reason,
                                                                      first)]}
                    yield sse.event({**chunk, "usage": None} if include_usage else chunk)
                    first = False
                if piece.usage is not None and include_usage:
                    yield sse.event({**header, "choices": [], "usage": piece.usage})
    except Exception:
        log.exception("streaming a response failed")
        yield sse.event(internal().body())
    yield sse.DONE
