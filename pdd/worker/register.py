"""A worker's membership in a router's fleet: register, heartbeat, deregister.

``RegistrationClient`` owns one background task that POSTs this worker's
``WorkerRegistration`` to ``{register_url}/internal/v1/workers`` every
``register_interval_s`` (the first POST admits the worker, the next ones are heartbeats; the
router removes a worker whose heartbeats stop and re-admits it on the next one), and DELETEs
it on ``stop()``. Every request has a deadline; failures are logged once per outage and
retried on the next beat, never raised: the worker keeps serving whatever the router does.
With authentication on at the router, the key comes from ``PDD_API_KEY`` (a secret: never
in the config file).

Lifecycle (``pdd.launch.worker``): ``start()`` once the engine is ready and the gRPC port is
known; ``stop()`` first thing at shutdown, so the router stops routing here before the
worker drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import httpx

from pdd.config import WorkerConfig
from pdd.kv_geometry import KvGeometry
from pdd.registration import REGISTRATION_PATH, WORKER_TOKEN_HEADER, WorkerRegistration

log = logging.getLogger(__name__)

ENV_KEY = "PDD_API_KEY"
WILDCARDS = ("0.0.0.0", "::", "")


def registration_for(
    worker: WorkerConfig,
    grpc_port: int,
    metrics_port: int,
    max_num_seqs: int,
    geometry: KvGeometry | None = None,
) -> WorkerRegistration:
    """What this worker announces: the address the router dials (advertise_host, else host)."""
    host = worker.advertise_host or worker.host
    if host in WILDCARDS:
        raise ValueError(f"worker {worker.id}: host {worker.host!r} is a wildcard; set "
                         "advertise_host to the address the router can dial")  # fmt: skip
    return WorkerRegistration(id=worker.id, role=worker.role, host=host, port=grpc_port,
                              datacenter=worker.datacenter, metrics_port=metrics_port,
                              max_num_seqs=max_num_seqs, geometry=geometry)  # fmt: skip


class RegistrationClient:
    """Heartbeats one registration to one router."""

    def __init__(
        self,
        url: str,
        registration: WorkerRegistration,
        interval_s: float,
        worker_token: bytes | None = None,
    ):
        self._base = url.rstrip("/").removesuffix("/v1")
        self._msg = registration
        self._interval = interval_s
        key = os.environ.get(ENV_KEY)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if worker_token is not None:
            headers[WORKER_TOKEN_HEADER] = worker_token.decode()
        self._http = httpx.AsyncClient(headers=headers, timeout=max(1.0, interval_s))
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self.beats = 0  # successful POSTs

    async def beat(self) -> bool:
        """One POST; True when the router took it."""
        try:
            resp = await self._http.post(
                self._base + REGISTRATION_PATH, json=self._msg.model_dump(mode="json")
            )
            resp.raise_for_status()
        except httpx.HTTPStatusError as exc:  # refused: say what the router said, e.g. geometry
            if not self._failing:
                log.warning("registration with %s refused (%d): %s (retrying every %g s)",
                            self._base, exc.response.status_code, exc.response.text[:500],
                            self._interval)  # fmt: skip
            self._failing = True
            return False
        except httpx.HTTPError as exc:
            if not self._failing:
                log.warning("registration with %s failed: %s (retrying every %g s)",
                            self._base, exc, self._interval)  # fmt: skip
            self._failing = True
            return False
        if self._failing or self.beats == 0:
            log.info("registered with %s as %s (%s)", self._base, self._msg.id,
                     resp.json().get("status"))  # fmt: skip
        self._failing = False
        self.beats += 1
        return True

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pdd-register")

    async def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating, deregister (bounded; ``deregister=False`` leaves like a crashed
        worker: the router expires it), close the HTTP client."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if deregister:
            try:
                await self._http.delete(f"{self._base}{REGISTRATION_PATH}/{self._msg.id}")
            except httpx.HTTPError as exc:
                log.warning("deregistration from %s failed: %s", self._base, exc)
        await self._http.aclose()

    async def _loop(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self._interval)
