"""The router's fleet as one object: membership, health and the snapshot views.

``WorkerPool`` composes ``members.Members`` (one ``WorkerClient`` per worker, run-time
joins and leaves, load: ``track``) and ``health.HealthPoller`` (the background health polls,
``mark_unhealthy``), and owns the views routing reads: ``view()`` (the ``FleetView``
snapshot), and the prefix views. Lifecycle: ``start()`` in the app's lifespan (inside the
serving event loop), ``stop()`` at shutdown.

Membership: see ``members``; a removed worker's DRC view and P-prefix view go at once.

Prefix views: per MainDecode the DRC replica (``drc_views``); per Prefill and MainDecode the
LRU of the prompts the router sent it (``routed_prefixes``, updated by ``note_routed`` after
each decision). For MD the routed view is only an affinity hint (the replica lags by up to one
health poll, and a conversation's next turn often comes sooner); WAN estimates use the replica.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

from pdd.config import PddConfig, WorkerConfig
from pdd.kv_geometry import KvGeometry
from pdd.proto import worker_pb2
from pdd.protocol import Role, RouterMode
from pdd.router.decide.view import Decision, FleetView, WanLinkView, WorkerView
from pdd.router.fleet.deferred import Deferred, DeferredKv
from pdd.router.fleet.drc_views import DrcViews
from pdd.router.fleet.health import HealthPoller
from pdd.router.fleet.members import Members, WorkerState
from pdd.router.fleet.routed_prefixes import RoutedPrefixes
from pdd.router.fleet.workers import WorkerClient

log = logging.getLogger(__name__)


class WorkerPool:
    """Clients, health and load of every worker, and the views routing reads."""

    def __init__(self, cfg: PddConfig):
        self._cfg = cfg
        self._members = Members(cfg)
        mds = [w.id for w in cfg.workers if w.role is Role.MAIN_DECODE]
        self.drc: DrcViews | None = None
        if cfg.router.mode is RouterMode.PDD:
            self.drc = DrcViews(mds, cfg.model)
        self.routed = RoutedPrefixes(cfg.model, cfg.router.pdd.routed_prefix_blocks)
        self._deferred = DeferredKv(cfg.model, cfg.router.pdd.send_kv_deadline_s)
        self._health = HealthPoller(self._members, cfg.router, self.drc)

    async def start(self) -> None:
        """Open channels and start polling. Must run inside the serving event loop."""
        self._members.connect()
        self._health.start()

    async def stop(self) -> None:
        await self._health.stop()
        await self._members.close()

    async def wait_first_poll(self, timeout: float) -> None:
        """Wait until every worker was polled once (or the timeout passes)."""
        await self._health.wait_first_poll(timeout)

    # --- membership -------------------------------------------------------------------------

    def add(
        self,
        worker: WorkerConfig,
        source: str,
        max_num_seqs: int = 0,
        geometry: KvGeometry | None = None,
    ) -> str:
        """Admit (or re-address) a worker that joined at run time; returns added | updated |
        unchanged. Raises InvalidRequestError when the id belongs to another source or its KV
        geometry is another model's (``fleet.geometry.GeometryGate``)."""
        result = self._members.add(worker, source, max_num_seqs, geometry)
        if result != "unchanged" and self.drc is not None and worker.role is Role.MAIN_DECODE:
            self.drc.add(worker.id)
        return result

    def remove(self, worker_id: str, reason: str) -> bool:
        """Take a run-time worker out of the fleet (config workers stay). Returns whether it
        was there."""
        st = self._members.remove(worker_id)
        if st is None:
            return False
        if self.drc is not None and st.config.role is Role.MAIN_DECODE:
            self.drc.remove(worker_id)
        self.routed.forget(worker_id)
        self._deferred.forget(worker_id)
        log.warning("worker %s left the fleet: %s", worker_id, reason)
        return True

    def members(self, source: str) -> dict[str, WorkerConfig]:
        return self._members.of_source(source)

    def client(self, worker_id: str) -> WorkerClient:
        return self._members.client(worker_id)

    def last_stats(self, worker_id: str) -> worker_pb2.StatsResponse | None:
        """The worker's last Stats answer (None before the first good poll)."""
        return self._members.states[worker_id].stats

    def geometry(self, worker_id: str) -> KvGeometry | None:
        """The KV geometry the worker reported (None: none yet, or it left the fleet)."""
        st = self._members.states.get(worker_id)
        return None if st is None else st.geometry

    @contextlib.contextmanager
    def track(self, worker_id: str) -> Iterator[None]:
        """Count one request in flight on a worker for as long as the block runs."""
        with self._members.track(worker_id):
            yield

    # --- health -----------------------------------------------------------------------------

    def any_healthy(self) -> bool:
        return self._health.any_healthy()

    def mark_unhealthy(self, worker_id: str, reason: str) -> None:
        """A request saw the worker fail; stop routing to it until the next good poll."""
        self._health.mark_unhealthy(worker_id, reason)

    # --- views ------------------------------------------------------------------------------

    def view(self) -> FleetView:
        workers = tuple(_worker_view(st) for st in self._members.states.values())
        return FleetView(self._cfg.router.mode, workers, self._cfg.router.pdd)

    # ``cache_salt``: the caller's prefix-cache namespace; blocks of another never count.

    def md_cached_tokens(
        self, prompt_token_ids: Sequence[int], cache_salt: str = ""
    ) -> dict[str, int]:
        """Per MainDecode, prompt tokens its DRC holds (router's replica; empty outside pdd)."""
        return {} if self.drc is None else self.drc.cached_tokens(prompt_token_ids, cache_salt)

    def md_routed_tokens(
        self, prompt_token_ids: Sequence[int], cache_salt: str = ""
    ) -> dict[str, int]:
        """Per MainDecode, prompt tokens of the prefix the router recently routed there (the
        affinity hint for turns that come before the DRC replica caught up)."""
        if self.drc is None:
            return {}
        sizes = self._block_sizes(Role.MAIN_DECODE)
        return self.routed.cached_tokens(prompt_token_ids, sizes, cache_salt)

    def p_cached_tokens(
        self, prompt_token_ids: Sequence[int], cache_salt: str = ""
    ) -> dict[str, int]:
        """Per Prefill, prompt tokens of the prefix the router recently sent it."""
        sizes = self._block_sizes(Role.PREFILL)
        return self.routed.cached_tokens(prompt_token_ids, sizes, cache_salt)

    # KV on its way to an MD that no request waits for (``deferred``).

    def defer_kv(self, md: str, kv_id: str, p: str, prompt_token_ids: Sequence[int],
                 cache_salt: str = "") -> None:  # fmt: skip
        self._deferred.add(md, kv_id, p, prompt_token_ids, self._block_size(md), cache_salt,
                           time.monotonic())  # fmt: skip

    def superseded_kv(self, md: str, prompt_token_ids: Sequence[int],
                      cache_salt: str = "") -> list[Deferred]:  # fmt: skip
        """The deferred transfers to ``md`` that a request with this prompt makes redundant
        (forgotten here; the caller cancels them)."""
        return self._deferred.superseded_by(md, prompt_token_ids, self._block_size(md),
                                            cache_salt, time.monotonic())  # fmt: skip

    def _block_size(self, worker_id: str) -> int:
        st = self._members.states.get(worker_id)
        return st.stats.block_size if st is not None and st.stats is not None else 0

    def _block_sizes(self, role: Role) -> dict[str, int]:
        return {i: st.stats.block_size if st.stats else 0 for i, st in self._members.states.items()
                if st.config.role is role}  # fmt: skip

    def note_routed(
        self, decision: Decision, prompt_token_ids: Sequence[int], cache_salt: str = ""
    ) -> None:
        """After a decision: count it per worker, and the KV blocks it will hold there until
        the worker's next Stats say so (P stages the prompt, RLD lands it, MD stores what it
        lacks); remember the prompt on its P and MD."""
        n = len(prompt_token_ids)
        for role, worker_id in decision.assignments:
            st = self._members.states.get(worker_id)
            if st is None:
                continue
            st.served += 1
            if st.stats is not None and st.stats.block_size > 0:
                lacks = n - decision.md_cached_tokens if role is Role.MAIN_DECODE else n
                st.routed_blocks += lacks // st.stats.block_size
            remembered = role is Role.PREFILL or (role is Role.MAIN_DECODE and self.drc)
            if remembered and st.stats is not None:
                self.routed.record(worker_id, prompt_token_ids, st.stats.block_size, cache_salt)

    def describe(self) -> list[dict[str, object]]:
        """Per-worker status for /health and /debug endpoints."""
        return [
            {
                "id": st.config.id,
                "role": st.config.role.value,
                "source": st.source,
                "served": st.served,
                "restarts": st.restarts,
                "target": st.client.target if st.client else None,
                "healthy": st.healthy,
                "in_flight": st.in_flight,
                "running": st.stats.running_requests if st.stats else None,
                "last_error": None if st.healthy else st.last_error,
                "geometry": st.geometry.model_dump() if st.geometry else None,
                "admitted": st.refused is None,
                **self._describe_drc(st),
            }
            for st in self._members.states.values()
        ]

    def refused(self) -> dict[str, str]:
        """Workers whose KV geometry was not admitted (id -> reason), members or not."""
        return dict(self._members.gate.refused)

    def _describe_drc(self, st: WorkerState) -> dict[str, object]:
        if self.drc is None or st.config.role is not Role.MAIN_DECODE:
            return {}
        return {"drc": self.drc.describe(st.config.id)}


def _worker_view(st: WorkerState) -> WorkerView:
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
        wan_links=tuple(
            (w.peer, WanLinkView(w.bandwidth_bps, w.rtt_s, w.queued_bytes)) for w in stats.wan_links
        ),  # fmt: skip
        wan_wire_ratio=stats.wan_wire_ratio,
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        prefill_fixed_s=stats.prefill_fixed_s,
        served=st.served,
        source=st.source,
        restarts=st.restarts,
        geometry=st.geometry,
        kv_arena_blocks=stats.kv_arena_blocks,
        kv_free_blocks=max(0, stats.kv_free_blocks - st.routed_blocks),
    )
