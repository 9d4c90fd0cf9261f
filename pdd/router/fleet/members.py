"""Fleet membership: one ``WorkerState`` (and ``WorkerClient``) per worker, and load.

The workers of ``cfg.workers`` (source ``config``) are there for the router's life; others
join and leave at run time through ``add(worker, source)`` / ``remove(id)``
(``pdd.router.fleet.registry``: source ``registered``; ``pdd.router.fleet.discovery``:
``dns:NAME``). A removed worker's client is closed once this router has no request left on it
(``track``: requests already running there finish or fail on their own).

Lifecycle: ``connect()`` inside the serving event loop (``WorkerPool.start``), ``close()`` at
shutdown. Health is ``health.HealthPoller``'s; the snapshot views are ``pool.WorkerPool``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdd.config import PddConfig, WorkerConfig
from pdd.errors import InvalidRequestError, UnavailableError
from pdd.kv_geometry import KvGeometry
from pdd.proto import worker_pb2
from pdd.router.fleet.geometry import GeometryGate
from pdd.router.fleet.worker_auth import WorkerCredentials
from pdd.router.fleet.workers import WorkerClient

log = logging.getLogger(__name__)

CONFIG = "config"  # the source of the workers listed in cfg.workers


@dataclass
class WorkerState:
    config: WorkerConfig
    max_num_seqs: int  # the engine config's; the worker's Stats override it when set
    client: WorkerClient | None = None
    healthy: bool = False
    in_flight: int = 0
    stats: worker_pb2.StatsResponse | None = None
    last_error: str = "not polled yet"
    source: str = CONFIG
    served: int = 0
    retired: bool = False  # removed from the fleet; the client closes at in_flight 0
    missed_polls: int = 0  # consecutive Health/Stats timeouts
    polling: bool = False  # a health poll of this worker is in flight
    instance_id: str = ""  # the worker process's id from its last Health ("" before the first)
    restarts: int = 0  # instance id changes seen: the worker restarted (crash, OOM, redeploy)
    geometry: KvGeometry | None = None  # from its last Health (or its registration)
    refused: str | None = None  # why its KV geometry is not admitted (None: admitted)
    routed_blocks: int = 0  # KV blocks routed to it since its last Stats (taken before it says)
    warmed: set[str] = field(default_factory=set)  # P: receivers it was asked to warm up to


class Members:
    """Every worker's state and client, by id."""

    def __init__(self, cfg: PddConfig) -> None:
        self._cfg = cfg
        self._credentials = WorkerCredentials.from_config(cfg.security)  # token, TLS
        self.states = {w.id: WorkerState(w, cfg.engine_for(w.id).max_num_seqs) for w in cfg.workers}
        self.gate = GeometryGate.from_model_folder(cfg.model.resolved_path())
        self._started = False
        self._closing: set[asyncio.Task[None]] = set()

    def connect(self) -> None:
        """Open every channel. Must run inside the serving event loop."""
        self._started = True
        for st in self.states.values():
            self._connect(st)

    def _connect(self, st: WorkerState) -> None:
        if st.config.port == 0:
            st.last_error = "port 0: address unknown (pass the real port with --set)"
            log.warning("worker %s: %s", st.config.id, st.last_error)
            return
        st.client = WorkerClient(st.config, self._cfg.router, self._credentials)

    def add(
        self,
        worker: WorkerConfig,
        source: str,
        max_num_seqs: int = 0,
        geometry: KvGeometry | None = None,
    ) -> str:
        """Admit (or re-address) a worker that joined at run time; returns added | updated |
        unchanged. Raises InvalidRequestError when the id belongs to another source or its
        KV geometry is not admitted (``GeometryGate``: another model)."""
        refused = self.gate.refusal(worker.id, geometry)
        if refused is not None:
            raise InvalidRequestError(f"worker {worker.id} {refused}", param="geometry")
        st = self.states.get(worker.id)
        if st is not None and st.source != source:
            raise InvalidRequestError(
                f"worker id {worker.id!r} is already in the fleet (source {st.source})",
                param="id",
            )
        if st is not None and st.config == worker:
            return "unchanged"
        if st is not None:
            self._retire(st)
        new = WorkerState(worker, max_num_seqs, source=source, geometry=geometry)
        self.states[worker.id] = new
        if self._started:
            self._connect(new)
        log.info("worker %s (%s, %s:%d) joined the fleet via %s", worker.id, worker.role.value,
                 worker.host, worker.port, source)  # fmt: skip
        return "updated" if st is not None else "added"

    def remove(self, worker_id: str) -> WorkerState | None:
        """Take a run-time worker out (config workers stay); its state, or None."""
        st = self.states.get(worker_id)
        if st is None or st.source == CONFIG:
            return None
        del self.states[worker_id]
        self._retire(st)
        return st

    def check_geometry(self, st: WorkerState, geometry: KvGeometry | None) -> str | None:
        """Record the geometry a worker's Health reported (none reported: the one it
        registered with stays); the reason it is not admitted, or None."""
        st.geometry = geometry = geometry or st.geometry
        st.refused = self.gate.refusal(st.config.id, geometry)
        return st.refused

    def of_source(self, source: str) -> dict[str, WorkerConfig]:
        return {i: st.config for i, st in self.states.items() if st.source == source}

    def client(self, worker_id: str) -> WorkerClient:
        st = self.states.get(worker_id)
        if st is None or st.client is None:
            raise UnavailableError(f"worker {worker_id} has no client")
        return st.client

    @contextlib.contextmanager
    def track(self, worker_id: str) -> Iterator[None]:
        """Count one request in flight on a worker for as long as the block runs."""
        st = self.states.get(worker_id)
        if st is None:
            raise UnavailableError(f"worker {worker_id} left the fleet; retry")
        st.in_flight += 1
        try:
            yield
        finally:
            st.in_flight -= 1
            if st.retired and st.in_flight == 0:
                self._close_later(st)

    def _retire(self, st: WorkerState) -> None:
        st.retired, st.healthy = True, False
        if st.in_flight == 0:
            self._close_later(st)

    def _close_later(self, st: WorkerState) -> None:
        client, st.client = st.client, None
        if client is None:
            return
        task = asyncio.get_running_loop().create_task(client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every client (after the health polls stopped)."""
        await asyncio.gather(*(st.client.close() for st in self.states.values() if st.client))
        if self._closing:
            await asyncio.wait(set(self._closing))
