"""The request a task works for, carried across tasks (a contextvar) and processes (gRPC).

    router: bind_request(rid) in the HTTP handler -> every task it spawns sees the scope
            request_context_interceptors (client): each RPC carries x-request-id: rid,
              and is reported to the scope's observer (the router's request timeline)
    worker: RequestIdServerInterceptor: binds the id from the metadata for the handler,
            so its log lines carry the router's request id

``RequestScope`` is mutable on purpose: the router binds it before the request is routed
and attaches the timeline observer once the record exists; tasks created in between
(asyncio copies the context, i.e. the reference to the same scope) see the observer too.
Everything here runs on one event loop per process; nothing blocks.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

REQUEST_ID_METADATA = "x-request-id"


@dataclass(frozen=True, slots=True)
class RpcObservation:
    """One RPC a request made: ``response`` is the reply (None for streams and failures),
    ``error`` the gRPC status name or "CANCELLED" (None on success). Monotonic times."""

    worker: str
    method: str  # short name: "SendKv", "Generate", ...
    request: Any
    response: Any
    error: str | None
    started: float
    ended: float


RpcObserver = Callable[[RpcObservation], None]


@dataclass(slots=True)
class RequestScope:
    request_id: str
    observer: RpcObserver | None = None  # called on the event loop; must not block


_scope: contextvars.ContextVar[RequestScope | None] = contextvars.ContextVar(
    "pdd_request_scope", default=None
)


def bind_request(request_id: str) -> RequestScope:
    """Make ``request_id`` the current request of this context (and of tasks it creates)."""
    scope = RequestScope(request_id)
    _scope.set(scope)
    return scope


def current_scope() -> RequestScope | None:
    return _scope.get()


def current_request_id() -> str | None:
    scope = _scope.get()
    return None if scope is None else scope.request_id


def _with_request_id(details: grpc.aio.ClientCallDetails, rid: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata[REQUEST_ID_METADATA] = rid
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


def _short(method: bytes | str) -> str:
    text = method.decode() if isinstance(method, bytes) else method
    return text.rsplit("/", 1)[-1]


class _Reporter:
    """Shared by both client interceptors: ``peer`` is the worker id of the channel."""

    def __init__(self, peer: str):
        self._peer = peer

    def _report(self, scope, method, request, response, error, started) -> None:  # type: ignore[no-untyped-def]
        if scope.observer is not None:
            obs = RpcObservation(
                self._peer, _short(method), request, response, error, started, time.monotonic()
            )
            scope.observer(obs)


class _UnaryUnary(_Reporter, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        scope = _scope.get()
        if scope is None:
            return await continuation(client_call_details, request)
        details = _with_request_id(client_call_details, scope.request_id)
        started = time.monotonic()
        call = await continuation(details, request)
        if scope.observer is None:
            return call
        response, error = None, None
        try:
            response = await call  # the caller awaits the same finished call: same outcome
        except grpc.aio.AioRpcError as exc:
            error = exc.code().name
        except asyncio.CancelledError:
            error = "CANCELLED"
            raise
        finally:
            self._report(scope, details.method, request, response, error, started)
        return call


class _UnaryStream(_Reporter, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        scope = _scope.get()
        if scope is None:
            return await continuation(client_call_details, request)
        details = _with_request_id(client_call_details, scope.request_id)
        started = time.monotonic()
        call = await continuation(details, request)
        if scope.observer is not None:

            def done(c: grpc.aio.Call) -> None:
                error = "CANCELLED" if c.cancelled() else None
                self._report(scope, details.method, request, None, error, started)

            call.add_done_callback(done)  # the status arrived, or the caller cancelled
        return call


def request_context_interceptors(peer: str) -> list[grpc.aio.ClientInterceptor]:
    """The client interceptors of one channel to worker ``peer``: unary and server-streaming
    calls made inside a bound request carry ``x-request-id`` and are reported to the scope's
    observer; calls outside one (health polls, DRC events) pass through untouched. (grpc.aio
    files each interceptor object under one call type only, hence two objects.)"""
    return [_UnaryUnary(peer), _UnaryStream(peer)]


class RequestIdServerInterceptor(grpc.aio.ServerInterceptor):
    """Server side: binds the caller's ``x-request-id`` for the handler of each RPC (grpc.aio
    runs interceptors and the handler in one context)."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        rid = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == REQUEST_ID_METADATA:
                rid = value if isinstance(value, str) else value.decode()
                break
        _scope.set(None if rid is None else RequestScope(rid))  # never a leftover binding
        return await continuation(handler_call_details)
