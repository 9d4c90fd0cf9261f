"""The router's one error handler: every failure becomes OpenAI's error JSON.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

``pdd.errors`` classes carry their HTTP status and OpenAI ``type``; framework errors are
mapped here: malformed JSON -> 400 (as OpenAI and vLLM answer), a body that does not match the
schema -> 422, unknown route -> 404, wrong method -> 405. 429 and 503 carry ``Retry-After``.
Anything unexpected is logged with its traceback and answered 500 in the same shape.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdd.errors import InvalidRequestError, PddError

log = logging.getLogger(__name__)

_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def pdd_error_body(exc: PddError) -> dict[str, Any]:
    return error_body(exc.message, exc.error_type, exc.param, exc.code)


def error_response(exc: PddError, status_code: int | None = None) -> JSONResponse:
    """The JSON response for a pdd error (with Retry-After for 429/503)."""
    headers = {}
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return JSONResponse(
        pdd_error_body(exc), status_code=status_code or exc.status_code, headers=headers
    )


async def _on_pdd_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PddError)
    if exc.status_code >= 500:
        log.warning("request failed: %s: %s", type(exc).__name__, exc.message)
    return error_response(exc)


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        err = InvalidRequestError(
            "We could not parse the JSON body of your request. The body must be valid JSON.",
            code="invalid_json",
        )
        return error_response(err)
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    details = "; ".join(_describe(e) for e in errors[:5])
    err = InvalidRequestError(
        f"invalid request body: {details}", param=param, code="invalid_schema"
    )
    return error_response(err, status_code=422)


def _describe(error: Any) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
    return f"{loc}: {error.get('msg', 'invalid')}"


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    body = error_body(str(exc.detail), _HTTP_TYPES.get(status, "invalid_request_error"))
    return JSONResponse(body, status_code=status, headers=exc.headers)


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.error("internal error", exc_info=exc)
    body = error_body(f"internal error: {type(exc).__name__}", "internal_error")
    return JSONResponse(body, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(PddError, _on_pdd_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
