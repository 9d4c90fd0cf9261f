"""Graceful drain of the router (SIGTERM): accept nothing new, finish what is open, then stop.

    gate = DrainGate(in_flight, timeout_s)     one per app (``app.state.pdd_drain``)
    DrainMiddleware(app, gate)                 while draining: 503 + Retry-After, except /metrics
    await gate.drain()                         flips the gate, waits for open requests (bounded)

Lifecycle: the server's signal handler (``pdd.router.main``) runs ``drain()`` in the serving
loop and lets uvicorn shut down when it returns: open requests and streams had up to
``router.drain_timeout_s`` to finish; what is still open then is cancelled by uvicorn's own
shutdown, which aborts it on the workers. ``/health`` answers 503 from the first moment, so a
load balancer stops sending here while the open streams finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pdd.errors import UnavailableError
from pdd.router.http.errors import error_response

log = logging.getLogger(__name__)

POLL_S = 0.1
OPEN_PATHS = ("/metrics",)  # scraped until the end, so the drain itself is observable


class DrainGate:
    """Whether the router drains; ``in_flight`` counts requests admitted and not finished."""

    def __init__(self, in_flight: Callable[[], int], timeout_s: float):
        self._in_flight = in_flight
        self.timeout_s = timeout_s
        self.draining = False

    async def drain(self) -> int:
        """Refuse new requests; wait until none is open or the timeout passes. Returns how
        many were still open at the end (uvicorn's shutdown cancels them)."""
        self.draining = True
        open_now = self._in_flight()
        log.info("draining: refusing new requests; %d open, waiting up to %.0f s",
                 open_now, self.timeout_s)  # fmt: skip
        deadline = time.monotonic() + self.timeout_s
        while self._in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        left = self._in_flight()
        if left:
            log.warning("drain timeout: %d requests still open are cancelled", left)
        else:
            log.info("drained: no request open")
        return left


class DrainMiddleware:
    """Pure ASGI: while the gate is closed every HTTP request but /metrics gets 503."""

    def __init__(self, app: ASGIApp, gate: DrainGate):
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.gate.draining or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        err = UnavailableError(
            "this router is shutting down (draining) and accepts no new requests; retry "
            "shortly (another router instance, or this one after its restart)"
        )
        await error_response(err)(scope, receive, send)
