"""The router's fleet: one ``WorkerClient`` per configured worker, health polling, load.

``WorkerPool`` owns the clients, a background poll task, and the per-worker count of requests
this router has in flight (``track``). Lifecycle: ``start()`` in the app's lifespan (inside the
serving event loop), ``stop()`` at shutdown. ``view()`` is the snapshot routing policy reads.

Health: every ``router.health_interval_s`` each worker gets Health (and Stats when ready), with
``router.worker_rpc_timeout_s`` deadlines. A worker is healthy after a ready Health and
unhealthy after any failure; transitions are logged. A worker with port 0 has no known
address (the launcher passes real ports with ``--set``) and stays unhealthy. In router.mode
pdd the same loop keeps each MainDecode's DRC view fresh (``drc_views.DrcViews``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from pdd.config import PddConfig, WorkerConfig
from pdd.errors import PddError, UnavailableError
from pdd.proto import worker_pb2
from pdd.protocol import Role, RouterMode
from pdd.router.drc_views import DrcViews
from pdd.router.fleet import FleetView, WorkerView
from pdd.router.workers import WorkerClient

log = logging.getLogger(__name__)


@dataclass
class _WorkerState:
    config: WorkerConfig
    max_num_seqs: int  # the engine config's; the worker's Stats override it when set
    client: WorkerClient | None = None
    healthy: bool = False
    in_flight: int = 0
    stats: worker_pb2.StatsResponse | None = None
    last_error: str = "not polled yet"


class WorkerPool:
    """Clients, health and load of every worker in ``cfg.workers``."""

    def __init__(self, cfg: PddConfig):
        self._cfg = cfg
        self._states = {
            w.id: _WorkerState(w, cfg.engine_for(w.id).max_num_seqs) for w in cfg.workers
        }
        mds = [w.id for w in cfg.workers if w.role is Role.MAIN_DECODE]
        self.drc: DrcViews | None = None
        if cfg.router.mode is RouterMode.PDD:
            self.drc = DrcViews(mds, cfg.model)
        self._poller: asyncio.Task[None] | None = None
        self._first_poll = asyncio.Event()

    async def start(self) -> None:
        """Open channels and start polling. Must run inside the serving event loop."""
        for st in self._states.values():
            if st.config.port == 0:
                st.last_error = "port 0: address unknown (pass the real port with --set)"
                log.warning("worker %s: %s", st.config.id, st.last_error)
                continue
            st.client = WorkerClient(st.config, self._cfg.router)
        self._poller = asyncio.create_task(self._poll_forever(), name="pdd-router-health")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        await asyncio.gather(*(st.client.close() for st in self._states.values() if st.client))

    async def wait_first_poll(self, timeout: float) -> None:
        """Wait until every worker was polled once (or the timeout passes)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_poll.wait(), timeout)

    def view(self) -> FleetView:
        workers = tuple(_worker_view(st) for st in self._states.values())
        return FleetView(self._cfg.router.mode, workers, self._cfg.router.pdd)

    def md_cached_tokens(self, prompt_token_ids: tuple[int, ...]) -> dict[str, int]:
        """Per MainDecode, prompt tokens its DRC holds (router's view; empty outside pdd)."""
        return {} if self.drc is None else self.drc.cached_tokens(prompt_token_ids)

    def client(self, worker_id: str) -> WorkerClient:
        st = self._states.get(worker_id)
        if st is None or st.client is None:
            raise UnavailableError(f"worker {worker_id} has no client")
        return st.client

    def last_stats(self, worker_id: str) -> worker_pb2.StatsResponse | None:
        """The worker's last Stats answer (None before the first good poll)."""
        return self._states[worker_id].stats

    def any_healthy(self) -> bool:
        return any(st.healthy for st in self._states.values())

    def describe(self) -> list[dict[str, object]]:
        """Per-worker status for /health and /debug endpoints."""
        return [
            {
                "id": st.config.id,
                "role": st.config.role.value,
                "target": st.client.target if st.client else None,
                "healthy": st.healthy,
                "in_flight": st.in_flight,
                "running": st.stats.running_requests if st.stats else None,
                "last_error": None if st.healthy else st.last_error,
                **self._describe_drc(st),
            }
            for st in self._states.values()
        ]

    def _describe_drc(self, st: _WorkerState) -> dict[str, object]:
        if self.drc is None or st.config.role is not Role.MAIN_DECODE:
            return {}
        return {"drc": self.drc.describe(st.config.id)}

    @contextlib.contextmanager
    def track(self, worker_id: str) -> Iterator[None]:
        """Count one request in flight on a worker for as long as the block runs."""
        st = self._states[worker_id]
        st.in_flight += 1
        try:
            yield
        finally:
            st.in_flight -= 1

    def mark_unhealthy(self, worker_id: str, reason: str) -> None:
        """A request saw the worker fail; stop routing to it until the next good poll."""
        st = self._states.get(worker_id)
        if st is not None:
            self._set_health(st, False, reason)

    async def _poll_forever(self) -> None:
        interval = self._cfg.router.health_interval_s
        while True:
            await asyncio.gather(*(self._poll(st) for st in self._states.values()))
            self._first_poll.set()
            await asyncio.sleep(interval)

    async def _poll(self, st: _WorkerState) -> None:
        if st.client is None:
            return
        try:
            health = await st.client.health()
            if not health.ready:
                self._set_health(st, False, "worker reports not ready")
                return
            st.stats = await st.client.stats()
        except PddError as exc:
            self._set_health(st, False, exc.message)
            return
        self._set_health(st, True, "")
        if self.drc is not None and st.config.role is Role.MAIN_DECODE:
            await self.drc.refresh(st.config.id, st.client)

    def _set_health(self, st: _WorkerState, healthy: bool, reason: str) -> None:
        if healthy != st.healthy:
            if healthy:
                log.info("worker %s (%s) is healthy", st.config.id, st.client and st.client.target)
            else:
                log.warning("worker %s is unhealthy: %s", st.config.id, reason)
        st.healthy = healthy
        if reason:
            st.last_error = reason


def _worker_view(st: _WorkerState) -> WorkerView:
    stats = st.stats or worker_pb2.StatsResponse()
    return WorkerView(
        id=st.config.id,
        role=st.config.role,
        healthy=st.healthy,
        in_flight=st.in_flight,
        running=stats.running_requests,
        waiting=stats.waiting_requests,
        kv_cache_usage=stats.kv_cache_usage,
        datacenter=st.config.datacenter,
        max_num_seqs=stats.max_num_seqs or st.max_num_seqs,
        block_size=stats.block_size,
        kv_block_bytes=stats.kv_block_bytes,
        wan_bandwidth_bps=stats.wan_bandwidth_bps,
        wan_rtt_s=stats.wan_rtt_s,
    )
