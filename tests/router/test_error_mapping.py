"""Every pdd error maps to OpenAI's error body with the right status and headers."""

from __future__ import annotations

import json

import pytest

from pdd.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    PddError,
    UnavailableError,
    WorkerError,
)
from pdd.router.http.errors import error_response

CASES = [
    (InvalidRequestError("bad", param="top_p"), 400, "invalid_request_error", "top_p", None),
    (ContextLengthError("long", param="max_tokens"), 400, "invalid_request_error", "max_tokens",
     "context_length_exceeded"),
    (ModelNotFoundError("nope", param="model"), 404, "invalid_request_error", "model",
     "model_not_found"),
    (PayloadTooLargeError("big"), 413, "invalid_request_error", None, "payload_too_large"),
    (OverloadedError("busy"), 429, "rate_limit_error", None, None),
    (UnavailableError("down"), 503, "service_unavailable", None, None),
    (WorkerError("boom"), 502, "worker_error", None, None),
    (PddError("internal"), 500, "internal_error", None, None),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "status", "type_", "param", "code"), CASES)
def test_error_response_shape(exc, status, type_, param, code):
    resp = error_response(exc)
    assert resp.status_code == status
    assert json.loads(resp.body) == {
        "error": {"message": exc.message, "type": type_, "param": param, "code": code}
    }
    retry = resp.headers.get("retry-after")
    assert retry == ("1" if status in (429, 503) else None)
