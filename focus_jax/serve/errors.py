"""Errors as OpenAI clients expect them: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can meet leaves the server as one of these bodies; tracebacks stay in the
server's log.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
"""What ``Retry-After`` says when the queue is full or the server is going away."""


class APIError(Exception):
    """A request the server answers with an error status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """400: a value the server cannot use; the message says which and why."""
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> APIError:
    """400 for a parameter the server does not implement."""
    return APIError(400, f"{what} is not supported by this server", param=param,
                    code="unsupported_parameter")


def queue_full(message: str) -> APIError:
    return APIError(429, f"{message}: retry later", type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def internal(message: str = "internal server error") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def validation_message(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for a body pydantic rejected (its first error; ``param``: the top-level field)."""
    first = errors[0] if errors else {"type": "missing", "loc": ("body",), "msg": "missing"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error")
        return invalid("the request body is not valid JSON" + (f" ({detail})" if detail else ""),
                       code="invalid_json")
    if not loc:
        return invalid("the request body must be a JSON object", code="invalid_body")
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] != "missing" and "input" in first:
        given = repr(first["input"])
        message += f", got {given if len(given) <= 80 else given[:77] + '...'}"
    return invalid(f"{'.'.join(loc)}: {message}", param=loc[0])


def install_handlers(app: FastAPI) -> None:
    """Answer every error the app can raise with an OpenAI-style body."""

    async def api_error(_request: Request, err: APIError) -> JSONResponse:
        return err.response()

    async def bad_body(request: Request, err: RequestValidationError) -> JSONResponse:
        request.app.state.serving.metrics.refused("invalid")
        if "json" not in request.headers.get("content-type", "json"):
            return invalid("send the body as JSON, with the header 'Content-Type: application/json'",
                           code="invalid_body").response()
        return validation_message(list(err.errors())).response()

    async def http_error(_request: Request, err: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        body = APIError(err.status_code, str(err.detail), type=kind,
                        code=str(err.detail).lower().replace(" ", "_"))
        return JSONResponse(body.body(), status_code=err.status_code, headers=err.headers)

    async def crash(_request: Request, err: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=err)
        return internal().response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, bad_body)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, crash)
