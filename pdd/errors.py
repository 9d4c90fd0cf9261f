"""One error hierarchy for pdd.

Adapters turn foreign errors (gRPC status codes, vLLM exceptions, socket errors) into these at
the boundary; the router maps them to OpenAI-style JSON bodies in one handler. Each error
carries the HTTP status the router should answer with and the OpenAI error ``type``.
"""

from __future__ import annotations


class PddError(Exception):
    """Base of every error pdd raises on purpose."""

    status_code: int = 500
    error_type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class ConfigError(PddError):
    """A configuration file or override is invalid. Raised at start-up, never per request."""

    error_type = "config_error"


class ModelError(PddError):
    """The model folder is missing, corrupt or cannot be prepared."""

    error_type = "model_error"


# --- request errors (4xx) -------------------------------------------------------------------


class InvalidRequestError(PddError):
    """The client sent parameters we cannot serve (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the model's context (HTTP 400)."""

    code = "context_length_exceeded"


class AuthenticationError(PddError):
    """Missing or wrong API key (HTTP 401)."""

    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFoundError(PddError):
    """The request names a model this deployment does not serve (HTTP 404)."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLargeError(PddError):
    """The request body is larger than the configured limit (HTTP 413)."""

    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


# --- capacity errors (429/503, always with Retry-After) ----------------------------------


class OverloadedError(PddError):
    """A bounded queue is full (HTTP 429 with Retry-After)."""

    status_code = 429
    error_type = "rate_limit_error"
    retry_after_s: float = 1.0


class UnavailableError(PddError):
    """No healthy worker can take the request (HTTP 503 with Retry-After)."""

    status_code = 503
    error_type = "service_unavailable"
    retry_after_s: float = 1.0


# --- data plane ----------------------------------------------------------------------------


class CacheFullError(OverloadedError):
    """MainDecode's DRC cannot hold the blocks now: the rest is pinned by running requests."""

    code = "kv_cache_full"


class CacheError(PddError):
    """A DRC call broke the block lifecycle (unknown lease, block not landing, pin not held)."""

    error_type = "cache_error"


class WorkerError(PddError):
    """A worker failed while serving a request (HTTP 502/500 at the router)."""

    status_code = 502
    error_type = "worker_error"


class PromptRefMissing(WorkerError):
    """A worker no longer holds the PrepareKv prompt a Generate referred to (refused before
    it started): the router sends that Generate again with the prompt whole."""


class RequestTimeoutError(PddError):
    """A request did not finish within ``router.request_timeout_s`` (HTTP 504)."""

    status_code = 504
    error_type = "timeout_error"
    code = "request_timeout"


class TransferError(PddError):
    """A KV transfer failed: peer gone, deadline passed, integrity check failed."""

    error_type = "transfer_error"


class TransferCancelled(TransferError):
    """The transfer was cancelled by its owner (a receiver's: the request moved on)."""


class TransferTimeout(TransferError):
    """The transfer did not finish before its deadline."""


class IntegrityError(TransferError):
    """A chunk failed its checksum or authentication tag; its bytes are never used."""


# --- test bed ------------------------------------------------------------------------------


class LabError(PddError):
    """The two-datacenter lab (pdd.lab) could not be made, reached or removed."""

    error_type = "lab_error"


class PermissionDeniedError(PddError):
    """The API key is valid but may not do this (HTTP 403), e.g. a non-admin key on /debug."""

    status_code = 403
    error_type = "permission_error"
    code = "permission_denied"


class RateLimitedError(OverloadedError):
    """One API key is over its requests or tokens per minute (HTTP 429 with Retry-After);
    other keys are unaffected."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s
