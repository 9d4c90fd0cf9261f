"""Workers that register themselves: admission, heartbeats, expiry (``router.fleet``).

    worker --POST /internal/v1/workers (WorkerRegistration)--> router   every interval_s
           <-- RegistrationReply (added | updated | unchanged) --
    worker --DELETE /internal/v1/workers/{id}--> router                 when it stops

``FleetRegistry`` owns the heartbeat table of registered workers and one expiry task; the
workers themselves live in the ``WorkerPool`` (source ``registered``), next to the config's
and the DNS-discovered ones, and get the same health polling (a registered worker that fails
Health is unhealthy, not routed to, until a good poll). A worker whose last heartbeat is older
than ``router.fleet.heartbeat_timeout_s`` is removed from the pool; its next heartbeat admits
it again. Lifecycle: ``start()`` / ``stop()`` in the app's lifespan, on the serving loop.

The endpoints (``routes``) exist only with ``router.fleet.accept_registrations``; with API
keys configured they need a key like every non-open path (``pdd.router.http.auth``), and with a
worker token (``security.worker_token_file``) they also need that token in the
``X-Pdd-Worker-Token`` header (constant-time check, ``SecretCheck``): only a holder of the fleet's secret can
add a worker that will be sent prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdd.config import WorkerConfig
from pdd.config.fleet import FleetConfig
from pdd.config.security import SecretCheck
from pdd.errors import AuthenticationError
from pdd.registration import (
    REGISTRATION_PATH,
    WORKER_TOKEN_HEADER,
    RegistrationReply,
    WorkerRegistration,
)
from pdd.router.fleet.discovery import DnsDiscovery, Resolver, resolve_dns
from pdd.router.fleet.pool import WorkerPool

log = logging.getLogger(__name__)

SOURCE = "registered"


class FleetRegistry:
    """Registered workers' heartbeats. Used on the router's event loop only."""

    def __init__(
        self, pool: WorkerPool, cfg: FleetConfig, clock: Callable[[], float] = time.monotonic
    ):
        self._pool = pool
        self._timeout = cfg.heartbeat_timeout_s
        self._clock = clock
        self._last_seen: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def register(self, msg: WorkerRegistration) -> RegistrationReply:
        """Admit a worker or refresh its heartbeat. Raises InvalidRequestError when the id
        belongs to a configured or discovered worker, or its KV geometry is another model's."""
        worker = WorkerConfig(id=msg.id, role=msg.role, host=msg.host, port=msg.port,
                              metrics_port=msg.metrics_port, datacenter=msg.datacenter)  # fmt: skip
        status = self._pool.add(worker, SOURCE, msg.max_num_seqs, msg.geometry)
        self._last_seen[msg.id] = self._clock()
        return RegistrationReply(id=msg.id, status=status, heartbeat_timeout_s=self._timeout)  # type: ignore[arg-type]

    def deregister(self, worker_id: str) -> bool:
        """The worker is leaving (its shutdown): remove it now."""
        self._last_seen.pop(worker_id, None)
        return self._pool.remove(worker_id, "deregistered")

    def workers(self) -> list[dict[str, object]]:
        """Every worker of the fleet as the pool describes it (any source)."""
        return self._pool.describe()

    def expire(self) -> list[str]:
        """Remove every registered worker whose heartbeat is overdue; returns their ids."""
        now = self._clock()
        gone = [i for i, seen in self._last_seen.items() if now - seen > self._timeout]
        for worker_id in gone:
            del self._last_seen[worker_id]
            self._pool.remove(worker_id, f"no heartbeat for {self._timeout:g} s")
        return gone

    def describe(self) -> list[dict[str, object]]:
        now = self._clock()
        return [{"id": i, "last_heartbeat_s_ago": round(now - seen, 3)}
                for i, seen in sorted(self._last_seen.items())]  # fmt: skip

    async def start(self) -> None:
        self._task = asyncio.create_task(self._expire_forever(), name="pdd-fleet-expiry")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _expire_forever(self) -> None:
        period = max(0.05, self._timeout / 4)
        while True:
            await asyncio.sleep(period)
            self.expire()


class FleetMembership:
    """What changes the fleet at run time: the registry and DNS discovery (``app.state.
    pdd_fleet``). ``start()`` after the pool started, ``stop()`` before it stops."""

    def __init__(
        self,
        pool: WorkerPool,
        cfg: FleetConfig,
        resolver: Resolver = resolve_dns,
        worker_token: bytes | None = None,
    ):
        self.registry = FleetRegistry(pool, cfg)
        # required of registering workers when set
        self.worker_token = SecretCheck(worker_token) if worker_token is not None else None
        self.discovery = DnsDiscovery(pool, cfg.dns, resolver)
        self._registrations = cfg.accept_registrations

    async def start(self) -> None:
        if self._registrations:
            await self.registry.start()
        await self.discovery.start()

    async def stop(self) -> None:
        await self.discovery.stop()
        await self.registry.stop()


routes = APIRouter()


def _registry(request: Request) -> FleetRegistry:
    """The registry, once the caller proved the fleet's worker token (when one is set)."""
    fleet: FleetMembership = request.app.state.pdd_fleet
    if fleet.worker_token is not None:
        given = request.headers.get(WORKER_TOKEN_HEADER, "").encode()
        if not fleet.worker_token.matches(given):
            raise AuthenticationError(
                f"registration needs the fleet's worker token in {WORKER_TOKEN_HEADER}",
                code="invalid_worker_token",
            )
    return fleet.registry


@routes.post(REGISTRATION_PATH)
async def register_worker(body: WorkerRegistration, request: Request) -> JSONResponse:
    """Admit a worker, or take its heartbeat."""
    reply = _registry(request).register(body)
    return JSONResponse(reply.model_dump(mode="json"))


@routes.delete(REGISTRATION_PATH + "/{worker_id}")
async def deregister_worker(worker_id: str, request: Request) -> JSONResponse:
    return JSONResponse({"id": worker_id, "removed": _registry(request).deregister(worker_id)})


@routes.get(REGISTRATION_PATH)
async def list_registered(request: Request) -> JSONResponse:
    registry = _registry(request)
    return JSONResponse({"registered": registry.describe(), "workers": registry.workers()})
