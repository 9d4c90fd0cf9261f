"""The router's fleet: one ``WorkerClient`` per worker, health polling, load, membership.

``WorkerPool`` owns the clients, a background poll task, and the per-worker count of requests
this router has in flight (``track``). Lifecycle: ``start()`` in the app's lifespan (inside the
serving event loop), ``stop()`` at shutdown. ``view()`` is the snapshot routing policy reads.

Membership: the workers of ``cfg.workers`` (source ``config``) are there for the pool's life;
others join and leave at run time through ``add(worker, source)`` / ``remove(id)``
(``pdd.router.fleet.registry``: source ``registered``; ``pdd.router.fleet.discovery``: ``dns:NAME``).
A removed worker's client is closed once this router has no request left on it (requests
already running there finish or fail on their own); its DRC view and P-prefix view go at once.

Prefix views: per MainDecode the DRC replica (``drc_views``); per Prefill and MainDecode the
LRU of the prompts the router sent it (``routed_prefixes``, updated by ``note_routed`` after
each decision). For MD the routed view is only an affinity hint (the replica lags by up to one
health poll, and a conversation's next turn often comes sooner); WAN estimates use the replica.

Health: every ``router.health_interval_s`` each worker gets Health (and Stats when ready), with
``router.worker_rpc_timeout_s`` deadlines. A worker is healthy after a ready Health and
unhealthy after any failure, except that a healthy worker may miss up to
``router.health_missed_polls - 1`` polls in a row by timing out (late, not gone); transitions
are logged. A worker with port 0 has no known
address (the launcher passes real ports with ``--set``) and stays unhealthy. In router.mode
pdd the same loop keeps each MainDecode's DRC view fresh (``drc_views.DrcViews``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdd.config import PddConfig, WorkerConfig
from pdd.errors import InvalidRequestError, PddError, UnavailableError
from pdd.proto import worker_pb2
from pdd.protocol import Role, RouterMode
from pdd.router.decide.view import Decision, FleetView, WorkerView
from pdd.router.fleet.drc_views import DrcViews
from pdd.router.fleet.routed_prefixes import RoutedPrefixes
from pdd.router.fleet.worker_auth import WorkerCredentials
from pdd.router.fleet.workers import WorkerClient

log = logging.getLogger(__name__)

CONFIG = "config"  # the source of the workers listed in cfg.workers


@dataclass
class _WorkerState:
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


class WorkerPool:
    """Clients, health and load of every worker in ``cfg.workers``."""

    def __init__(self, cfg: PddConfig):
        self._cfg = cfg
        self._credentials = WorkerCredentials.from_config(cfg.security)  # token, TLS
        self._states = {
            w.id: _WorkerState(w, cfg.engine_for(w.id).max_num_seqs) for w in cfg.workers
        }
        mds = [w.id for w in cfg.workers if w.role is Role.MAIN_DECODE]
        self.drc: DrcViews | None = None
        if cfg.router.mode is RouterMode.PDD:
            self.drc = DrcViews(mds, cfg.model)
        self.routed = RoutedPrefixes(cfg.model, cfg.router.pdd.routed_prefix_blocks)
        self._poller: asyncio.Task[None] | None = None
        self._first_poll = asyncio.Event()
        self._started = False
        self._closing: set[asyncio.Task[None]] = set()
        self._polls: set[asyncio.Task[None]] = set()  # health polls in flight

    async def start(self) -> None:
        """Open channels and start polling. Must run inside the serving event loop."""
        self._started = True
        for st in self._states.values():
            self._connect(st)
        self._poller = asyncio.create_task(self._poll_forever(), name="pdd-router-health")

    def _connect(self, st: _WorkerState) -> None:
        if st.config.port == 0:
            st.last_error = "port 0: address unknown (pass the real port with --set)"
            log.warning("worker %s: %s", st.config.id, st.last_error)
            return
        st.client = WorkerClient(st.config, self._cfg.router, self._credentials)

    # --- membership -------------------------------------------------------------------------

    def add(self, worker: WorkerConfig, source: str, max_num_seqs: int = 0) -> str:
        """Admit (or re-address) a worker that joined at run time; returns added | updated |
        unchanged. Raises InvalidRequestError when the id belongs to another source."""
        st = self._states.get(worker.id)
        if st is not None and st.source != source:
            raise InvalidRequestError(
                f"worker id {worker.id!r} is already in the fleet (source {st.source})",
                param="id",
            )
        if st is not None and st.config == worker:
            return "unchanged"
        if st is not None:
            self._retire(st)
        new = _WorkerState(worker, max_num_seqs, source=source)
        self._states[worker.id] = new
        if self.drc is not None and worker.role is Role.MAIN_DECODE:
            self.drc.add(worker.id)
        if self._started:
            self._connect(new)
        log.info("worker %s (%s, %s:%d) joined the fleet via %s", worker.id, worker.role.value,
                 worker.host, worker.port, source)  # fmt: skip
        return "updated" if st is not None else "added"

    def remove(self, worker_id: str, reason: str) -> bool:
        """Take a run-time worker out of the fleet (config workers stay). Returns whether it
        was there."""
        st = self._states.get(worker_id)
        if st is None or st.source == CONFIG:
            return False
        del self._states[worker_id]
        if self.drc is not None and st.config.role is Role.MAIN_DECODE:
            self.drc.remove(worker_id)
        self.routed.forget(worker_id)
        self._retire(st)
        log.warning("worker %s left the fleet: %s", worker_id, reason)
        return True

    def members(self, source: str) -> dict[str, WorkerConfig]:
        return {i: st.config for i, st in self._states.items() if st.source == source}

    def _retire(self, st: _WorkerState) -> None:
        st.retired, st.healthy = True, False
        if st.in_flight == 0:
            self._close_later(st)

    def _close_later(self, st: _WorkerState) -> None:
        client, st.client = st.client, None
        if client is None:
            return
        task = asyncio.get_running_loop().create_task(client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        for task in list(self._polls):
            task.cancel()
        await asyncio.gather(*self._polls, return_exceptions=True)
        await asyncio.gather(*(st.client.close() for st in self._states.values() if st.client))
        if self._closing:
            await asyncio.wait(set(self._closing))

    async def wait_first_poll(self, timeout: float) -> None:
        """Wait until every worker was polled once (or the timeout passes)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_poll.wait(), timeout)

    def view(self) -> FleetView:
        workers = tuple(_worker_view(st) for st in self._states.values())
        return FleetView(self._cfg.router.mode, workers, self._cfg.router.pdd)

    def md_cached_tokens(self, prompt_token_ids: Sequence[int]) -> dict[str, int]:
        """Per MainDecode, prompt tokens its DRC holds (router's replica; empty outside pdd)."""
        return {} if self.drc is None else self.drc.cached_tokens(prompt_token_ids)

    def md_routed_tokens(self, prompt_token_ids: Sequence[int]) -> dict[str, int]:
        """Per MainDecode, prompt tokens of the prefix the router recently routed there (the
        affinity hint for turns that come before the DRC replica caught up)."""
        if self.drc is None:
            return {}
        return self.routed.cached_tokens(prompt_token_ids, self._block_sizes(Role.MAIN_DECODE))

    def p_cached_tokens(self, prompt_token_ids: Sequence[int]) -> dict[str, int]:
        """Per Prefill, prompt tokens of the prefix the router recently sent it."""
        return self.routed.cached_tokens(prompt_token_ids, self._block_sizes(Role.PREFILL))

    def _block_sizes(self, role: Role) -> dict[str, int]:
        return {i: st.stats.block_size if st.stats else 0 for i, st in self._states.items()
                if st.config.role is role}  # fmt: skip

    def note_routed(self, decision: Decision, prompt_token_ids: Sequence[int]) -> None:
        """After a decision: count it per worker; remember the prompt on its P and MD."""
        for role, worker_id in decision.assignments:
            st = self._states.get(worker_id)
            if st is None:
                continue
            st.served += 1
            remembered = role is Role.PREFILL or (role is Role.MAIN_DECODE and self.drc)
            if remembered and st.stats is not None:
                self.routed.record(worker_id, prompt_token_ids, st.stats.block_size)

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
                "source": st.source,
                "served": st.served,
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
        st = self._states.get(worker_id)
        if st is None:
            raise UnavailableError(f"worker {worker_id} left the fleet; retry")
        st.in_flight += 1
        try:
            yield
        finally:
            st.in_flight -= 1
            if st.retired and st.in_flight == 0:
                self._close_later(st)

    def mark_unhealthy(self, worker_id: str, reason: str) -> None:
        """A request saw the worker fail; stop routing to it until the next good poll."""
        st = self._states.get(worker_id)
        if st is not None:
            self._set_health(st, False, reason)

    async def _poll_forever(self) -> None:
        """Each round polls every worker not still being polled, waits for the round at most
        ~2 RPC deadlines, then sleeps ``health_interval_s``. A poll that outlives its round (a
        channel closed under its call) finishes, or is abandoned at ``bound``, on its own:
        it never holds up the polls of the other workers."""
        interval = self._cfg.router.health_interval_s
        rpc = self._cfg.router.worker_rpc_timeout_s
        bound = 3 * rpc + 1.0  # Health + Stats (+ DrcEvents), each with the RPC deadline
        while True:
            fresh = [st for st in list(self._states.values()) if not st.polling]
            tasks = {asyncio.create_task(self._bounded_poll(st, bound)) for st in fresh}
            self._polls |= tasks
            for t in tasks:
                t.add_done_callback(self._polls.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=2 * rpc + 0.5)
            self._first_poll.set()
            await asyncio.sleep(interval)

    async def _bounded_poll(self, st: _WorkerState, bound_s: float) -> None:
        st.polling = True
        try:
            await asyncio.wait_for(self._poll(st), bound_s)
        except TimeoutError:
            if not st.retired:
                self._set_health(st, False, f"health poll stuck for {bound_s:g} s")
        finally:
            st.polling = False

    async def _poll(self, st: _WorkerState) -> None:
        """One worker's poll. Never raises: one worker (even one retired and closed while its
        poll was in flight) must not stop the loop that polls every other."""
        client = st.client  # _close_later may take st.client away while we await
        if client is None or st.retired:
            return
        try:
            health = await client.health()
            if not health.ready:
                self._set_health(st, False, "worker reports not ready")
                return
            st.stats = await client.stats()
        except PddError as exc:
            self._missed(st, exc)
            return
        except Exception as exc:  # noqa: BLE001 - e.g. the channel closed under the call
            if not st.retired:
                log.warning("health poll of %s failed: %r", st.config.id, exc)
                self._set_health(st, False, f"health poll failed: {exc!r}")
            return
        st.missed_polls = 0
        if st.retired:  # removed while polled
            return
        self._set_health(st, True, "")
        if self.drc is not None and st.config.role is Role.MAIN_DECODE:
            await self.drc.refresh(st.config.id, client)

    def _missed(self, st: _WorkerState, exc: PddError) -> None:
        """A failed poll: unhealthy now, unless a healthy worker is only late (a timeout) for
        fewer than ``health_missed_polls`` polls in a row."""
        st.missed_polls = st.missed_polls + 1 if exc.code == "timeout" else 0
        late = 0 < st.missed_polls < self._cfg.router.health_missed_polls
        if late and st.healthy:
            log.info("worker %s missed a health poll (%d in a row): %s",
                     st.config.id, st.missed_polls, exc.message)  # fmt: skip
            return
        self._set_health(st, False, exc.message)

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
        served=st.served,
        source=st.source,
    )
