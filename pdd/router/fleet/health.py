"""Health polling of every fleet member.

Every ``router.health_interval_s`` each worker gets Health (and Stats when ready), with
``router.worker_rpc_timeout_s`` deadlines. A worker is healthy after a ready Health and
unhealthy after any failure, except that a healthy worker may miss up to
``router.health_missed_polls - 1`` polls in a row by timing out (late, not gone); transitions
are logged. A worker with port 0 has no known address (the launcher passes real ports with
``--set``) and stays unhealthy. In router.mode pdd the same loop keeps each MainDecode's DRC
view fresh (``drc_views.DrcViews``). A request that sees a worker fail marks it unhealthy at
once (``mark_unhealthy``) until its next good poll. After a good poll of a Prefill worker the
router names it every healthy receiver (a worker whose Stats give a KV address) it was not
named before, through WarmKv: P opens and measures those links before a request needs them
(``pdd.transfer.tcp_send``); a restarted P, or a restarted receiver, is named again.

Lifecycle: ``start()`` inside the serving event loop, ``stop()`` at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdd.config.router import RouterConfig
from pdd.errors import PddError
from pdd.kv_geometry import KvGeometry
from pdd.proto import worker_pb2
from pdd.protocol import Role
from pdd.router.fleet.drc_views import DrcViews
from pdd.router.fleet.members import Members, WorkerState
from pdd.router.fleet.workers import WorkerClient

log = logging.getLogger(__name__)


class HealthPoller:
    """One background task polling ``members``; the polls of slow workers never wait on
    each other."""

    def __init__(self, members: Members, cfg: RouterConfig, drc: DrcViews | None) -> None:
        self._members = members
        self._cfg = cfg
        self._drc = drc
        self._poller: asyncio.Task[None] | None = None
        self._first_poll = asyncio.Event()
        self._polls: set[asyncio.Task[None]] = set()  # health polls in flight

    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever(), name="pdd-router-health")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        for task in list(self._polls):
            task.cancel()
        await asyncio.gather(*self._polls, return_exceptions=True)

    async def wait_first_poll(self, timeout: float) -> None:
        """Wait until every worker was polled once (or the timeout passes)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_poll.wait(), timeout)

    def mark_unhealthy(self, worker_id: str, reason: str) -> None:
        """A request saw the worker fail; stop routing to it until the next good poll."""
        st = self._members.states.get(worker_id)
        if st is not None:
            self._set_health(st, False, reason)

    def any_healthy(self) -> bool:
        return any(st.healthy for st in self._members.states.values())

    async def _poll_forever(self) -> None:
        """Each round polls every worker not still being polled, waits for the round at most
        ~2 RPC deadlines, then sleeps ``health_interval_s``. A poll that outlives its round (a
        channel closed under its call) finishes, or is abandoned at ``bound``, on its own:
        it never holds up the polls of the other workers."""
        interval = self._cfg.health_interval_s
        rpc = self._cfg.worker_rpc_timeout_s
        bound = 3 * rpc + 1.0  # Health + Stats (+ DrcEvents), each with the RPC deadline
        while True:
            fresh = [st for st in list(self._members.states.values()) if not st.polling]
            tasks = {asyncio.create_task(self._bounded_poll(st, bound)) for st in fresh}
            self._polls |= tasks
            for t in tasks:
                t.add_done_callback(self._polls.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=2 * rpc + 0.5)
            self._first_poll.set()
            await asyncio.sleep(interval)

    async def _bounded_poll(self, st: WorkerState, bound_s: float) -> None:
        st.polling = True
        try:
            await asyncio.wait_for(self._poll(st), bound_s)
        except TimeoutError:
            if not st.retired:
                self._set_health(st, False, f"health poll stuck for {bound_s:g} s")
        finally:
            st.polling = False

    async def _poll(self, st: WorkerState) -> None:
        """One worker's poll. Never raises: one worker (even one retired and closed while its
        poll was in flight) must not stop the loop that polls every other."""
        client = st.client  # Members may take st.client away while we await
        if client is None or st.retired:
            return
        try:
            health = await client.health()
            self._note_instance(st, health.instance_id)
            if not health.ready:
                self._set_health(st, False, "worker reports not ready")
                return
            refused = self._members.check_geometry(st, KvGeometry.from_proto(health.geometry))
            if refused is not None:  # another model: never routed to (GeometryGate)
                self._set_health(st, False, refused)
                return
            st.stats = await client.stats()
            st.routed_blocks = 0  # what was routed before is in these figures (or released)
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
        if st.config.role is Role.PREFILL:
            await self._warm_links(st, client)
        if self._drc is not None and st.config.role is Role.MAIN_DECODE:
            await self._drc.refresh(st.config.id, client)

    async def _warm_links(self, st: WorkerState, client: WorkerClient) -> None:
        """Name P the receivers it was not named yet (module doc). One try per pair: a P that
        cannot warm up (an older version, no sender of that kind) sends cold, as before."""
        new: dict[str, worker_pb2.PeerAddress] = {}
        for other in list(self._members.states.values()):
            stats = other.stats
            if not other.healthy or other.refused is not None or stats is None:
                continue
            a = stats.kv_address
            key = f"{other.config.id}/{other.instance_id}/{a.transport}:{a.host}:{a.port}"
            if a.transport and key not in st.warmed:
                new[key] = a
        if not new:
            return
        st.warmed |= new.keys()
        try:
            warming = await client.warm_kv(list(new.values()))
        except PddError as exc:
            log.info("WarmKv on %s failed (its first transfers start cold): %s",
                     st.config.id, exc.message)  # fmt: skip
            return
        if warming:
            log.info("%s warms up its KV links to %d receiver(s)", st.config.id, warming)

    def _note_instance(self, st: WorkerState, instance_id: str) -> None:
        """A new instance id at the same address is a restarted worker process."""
        if not instance_id:  # a worker of a version that sends none
            return
        if st.instance_id and instance_id != st.instance_id:
            st.restarts += 1
            st.warmed.clear()
            log.warning("worker %s restarted (restart %d seen by this router)",
                        st.config.id, st.restarts)  # fmt: skip
        st.instance_id = instance_id

    def _missed(self, st: WorkerState, exc: PddError) -> None:
        """A failed poll: unhealthy now, unless a healthy worker is only late (a timeout) for
        fewer than ``health_missed_polls`` polls in a row."""
        st.missed_polls = st.missed_polls + 1 if exc.code == "timeout" else 0
        late = 0 < st.missed_polls < self._cfg.health_missed_polls
        if late and st.healthy:
            log.info("worker %s missed a health poll (%d in a row): %s",
                     st.config.id, st.missed_polls, exc.message)  # fmt: skip
            return
        self._set_health(st, False, exc.message)

    def _set_health(self, st: WorkerState, healthy: bool, reason: str) -> None:
        if healthy != st.healthy:
            if healthy:
                log.info("worker %s (%s) is healthy", st.config.id, st.client and st.client.target)
            else:
                log.warning("worker %s is unhealthy: %s", st.config.id, reason)
        st.healthy = healthy
        if reason:
            st.last_error = reason
