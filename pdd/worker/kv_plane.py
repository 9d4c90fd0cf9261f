"""The worker shell's KV plane: the shared-memory slot arena, the fence board, the transports.

Owns, for one worker process (prefill, relay_decode or main_decode):

- the ``SlotArena`` the KV connector in the engine core maps by name (one slot = one KV block
  of all layers; pdd-core-design.md "Where the bytes live"), and its ``Fences``;
- the transports: a receiver of one kind (with the role's hooks) and senders by kind, built
  from ``transfer`` with this worker's ``kv_port`` / ``host``;
- the byte counters of everything sent and received.

What the slots hold, who pins them and when they are released is the role's business
(pdd.prefill, pdd.relay_decode, pdd.main_decode); the plane only executes.

Lifecycle: ``KvPlane(spec, ...)`` creates the arenas (the engine's connector settings are known
from then on) -> ``start(hooks, on_sent)`` starts the transports and the fence poller ->
``stop()`` closes the transports (open transfers fail, pins drop), runs pending fence
callbacks, unmaps and unlinks the arenas. Call ``stop`` only after the engine stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from prometheus_client import Counter, Histogram

from pdd.cache.arena import FenceBoard, SlotArena, unlink_stale
from pdd.config import TransferConfig, WorkerConfig
from pdd.engine.connector_params import ConnectorSettings
from pdd.engine.types import KvConnectorSpec, KvRole
from pdd.errors import ConfigError, InvalidRequestError
from pdd.transfer import (
    InboundResult,
    LinkEstimate,
    PeerAddress,
    ReceiverHooks,
    TransferState,
    TransferStatus,
    Transport,
    create_transport,
)
from pdd.worker.capacity import ArenaSize
from pdd.worker.faults import WorkerFaults
from pdd.worker.inbound import split_wire_id
from pdd.worker.roles import KvAddress, WanLinkStats
from pdd.worker.slots import Fences

log = logging.getLogger(__name__)

ARENA_PREFIX = "pdd-kv"
FENCE_PREFIX = "pdd-kvfence"
PROGRESS_PREFIX = "pdd-kvprogress"
FENCE_WORDS = 4096  # concurrent requests with KV params (32 KiB of shared memory)
WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class PlaneSpec:
    """What a role needs from the shell (the composition root builds the plane from it)."""

    kv_role: KvRole  # the connector's role in the engine
    num_slots: int  # arena slots
    receiver: str | None = None  # transport kind of the KV receiver, None: sends only
    senders: tuple[str, ...] = ()  # transport kinds this worker sends with
    arenas: tuple[ArenaSize, ...] = ()  # how the slots divide (checked: pdd.worker.capacity)


def advertise_host(worker: WorkerConfig) -> str:
    """The address peers dial for this worker's KV receiver. ConfigError for a wildcard."""
    host = worker.kv_advertise_host
    if host in (None, "auto"):
        host = worker.host
    if host in WILDCARDS:
        raise ConfigError(
            f"worker {worker.id}: kv_advertise_host is required when host is {worker.host!r}"
        )
    return host


# Per-transport counters of outbound KV (P: ucx toward RLD, tcp toward MD), one per process.
_TRANSFER_BYTES = Counter(
    "pdd_kv_transfer_bytes", "KV bytes sent and acknowledged, by transport.", ["role", "transport"]
)
_WIRE_BYTES = Counter(
    "pdd_kv_wire_bytes",
    "KV payload bytes put on the wire (after the codec; raw transports: as acknowledged).",
    ["role", "transport"],
)
_TRANSFER_SECONDS = Histogram(
    "pdd_kv_transfer_seconds",
    "Outbound KV transfer duration, send() to terminal, by transport.",
    ["role", "transport"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
_INTERNAL_ERRORS = Counter(
    "pdd_worker_kv_internal_errors",
    "Inbound KV transfers failed by a bug on this worker (logged with a traceback).",
    ["role"],
)
_TRANSFERS = Counter(
    "pdd_kv_transfers",
    "Outbound KV transfers by transport and how they ended (done, failed, cancelled).",
    ["role", "transport", "outcome"],
)


class KvPlane:
    def __init__(
        self, spec: PlaneSpec, slot_bytes: int, worker: WorkerConfig, transfer: TransferConfig
    ) -> None:
        self.spec = spec
        self._worker = worker
        self._transfer = transfer.model_copy(
            update={"listen_host": worker.host, "listen_port": worker.kv_port}
        )
        self._advertise = advertise_host(worker) if spec.receiver else worker.host
        for prefix in (ARENA_PREFIX, FENCE_PREFIX, PROGRESS_PREFIX):
            for name in unlink_stale(prefix):
                log.info("removed the stale KV arena %s of a dead worker", name)
        self.arena = SlotArena.create(spec.num_slots, slot_bytes, ARENA_PREFIX)
        self.fences = Fences(
            FenceBoard.create(FENCE_WORDS, FENCE_PREFIX),
            worker.kv_fence_timeout_s,
            FenceBoard.create(FENCE_WORDS, PROGRESS_PREFIX),
        )
        self.receiver: Transport | None = None
        self._senders: dict[str, Transport] = {}
        self._on_sent: Callable[[TransferStatus], None] | None = None
        self._on_received: Callable[[InboundResult], None] | None = None
        self._lock = threading.Lock()
        self.bytes_sent = 0  # raw KV bytes acknowledged
        self.wire_bytes_sent = 0  # what crossed: after the WAN codec
        self.bytes_received = 0
        self._send_started: dict[int, float] = {}
        self._faults = WorkerFaults.of(worker)  # tests only: None unless worker.faults is set
        if spec.receiver:  # exported from the start (0), so a rate alert has a series
            _INTERNAL_ERRORS.labels(worker.role.value)
        log.info(
            "KV arena %s: %d slots of %d bytes (%s)",
            self.arena.ref.name, spec.num_slots, slot_bytes, spec.kv_role,
        )  # fmt: skip

    @property
    def transfer_deadline_s(self) -> float:
        """The transports' default deadline of one transfer."""
        return self._transfer.deadline_s

    def connector_spec(self) -> KvConnectorSpec:
        """What the engine loads: PddConnector mapping this plane's arena and fence board."""
        fences = self.fences
        progress = fences.progress.ref if fences.progress is not None else None
        settings = ConnectorSettings(
            arena=self.arena.ref, fences=fences.board.ref, progress=progress
        )
        return KvConnectorSpec(role=self.spec.kv_role, extra_config=settings.model_dump())

    # --- lifecycle ------------------------------------------------------------------------

    def start(
        self,
        hooks: ReceiverHooks | None = None,
        on_sent: Callable[[TransferStatus], None] | None = None,
    ) -> None:
        """Start the fence poller and the transports (on the event loop's thread).

        ``hooks.on_received`` and ``on_sent`` run on transport threads, after the plane
        counted the bytes; the other hooks (``allocate``, ``on_verified``: partial landing)
        go to the receiver as they are. Raises TransferError / ConfigError when a transport
        cannot start.
        """
        self.fences.start()
        self._on_sent = on_sent
        try:
            if self.spec.receiver is not None:
                assert hooks is not None, "a receiving plane needs the role's hooks"
                self._on_received = hooks.on_received
                wrapped = replace(hooks, on_received=self._received)
                self.receiver = self._make(self.spec.receiver, wrapped)
            for kind in self.spec.senders:
                self._senders[kind] = self._make(kind, None)
        except BaseException:
            self._close_transports()
            raise

    def _make(self, kind: str, hooks: ReceiverHooks | None) -> Transport:
        injected = self._faults.transport_faults(kind, self._transfer.deadline_s) if (
            self._faults is not None
        ) else None  # fmt: skip
        try:
            transport = create_transport(
                kind, self._transfer, hooks=hooks, on_finished=lambda st: self._sent(kind, st),
                faults=injected.hooks() if injected is not None else None,
            )  # fmt: skip
        except ImportError as exc:  # e.g. ucxx not installed on this machine
            raise ConfigError(f"the {kind} KV transport is not available here: {exc}") from exc
        transport.start()
        return transport

    async def stop(self) -> None:
        """Close transports, run pending fence callbacks, unlink the arenas. Idempotent."""
        self._close_transports()
        await self.fences.stop()
        for owned in (self.fences.board, self.fences.progress, self.arena):
            if owned is None:
                continue
            owned.close()
            owned.unlink()

    def _close_transports(self) -> None:
        transports = list(self._senders.values())
        if self.receiver is not None:
            transports.append(self.receiver)
        self._senders, self.receiver = {}, None
        if self._faults is not None:
            self._faults.release()  # senders a drop fault holds must not delay close
        for t in transports:
            t.close()

    # --- transports -----------------------------------------------------------------------

    def sender(self, kind: str) -> Transport:
        """The transport that sends to a peer of ``kind``; InvalidRequestError if none."""
        transport = self._senders.get(kind)
        if transport is None:
            have = ", ".join(sorted(self._senders)) or "none"
            raise InvalidRequestError(
                f"worker {self._worker.id} cannot send KV over {kind!r} (it has {have})",
                param="destinations",
            )
        return transport

    def address(self) -> KvAddress:
        """Where peers send this worker's inbound KV (PrepareKv's answer)."""
        if self.receiver is None:
            return KvAddress()
        a = self.receiver.address
        host = a.host if self.spec.receiver == "inproc" else self._advertise
        return KvAddress(
            transport=self.spec.receiver, host=host, port=a.port, ucx_address=a.ucx_address,
            host_id=a.host_id, name=a.name or self._worker.id, probes=a.probes,
        )  # fmt: skip

    def warm(self, peers: Sequence[KvAddress]) -> int:
        """Warm up the links to ``peers`` this worker has a sender for (``Transport.warm``);
        returns how many warm-ups started."""
        started = 0
        for a in peers:
            transport = self._senders.get(a.transport)
            if transport is not None and transport.warm(a.peer()):
                started += 1
        return started

    def open_transfers(self) -> int:
        """Outbound + inbound transfers not yet terminal, over every transport."""
        total = 0
        for t in self._transports():
            s = t.stats()
            total += s.open_outbound + s.open_inbound
        return total

    def wan_estimate(self) -> LinkEstimate | None:
        """The TCP sender's estimate toward its best-measured peer (P -> MD), if any."""
        tcp = self._senders.get("tcp")
        estimates = getattr(tcp, "link_estimates", None)
        if estimates is None:
            return None
        measured = list(estimates().values())
        return max(measured, key=lambda e: (e.samples, e.bandwidth_bps), default=None)

    def wan_links(self) -> tuple[WanLinkStats, ...]:
        """The TCP (WAN) sender's link to each receiver: its estimate and what is queued."""
        tcp = self._senders.get("tcp")
        if tcp is None:
            return ()
        estimates = tcp.link_estimates()
        queued = tcp.queued_bytes()
        links = []
        for peer in sorted(estimates.keys() | queued.keys()):
            est = estimates.get(peer)
            bandwidth, rtt = (est.bandwidth_bps, est.rtt_s) if est is not None else (0.0, 0.0)
            links.append(WanLinkStats(peer, bandwidth, rtt, queued.get(peer, 0)))
        return tuple(links)

    def wan_wire_ratio(self) -> float:
        """Learned wire/raw ratio of the TCP (WAN) sender's default codec; 1.0 raw."""
        tcp = self._senders.get("tcp")
        return tcp.wire_ratio() if tcp is not None else 1.0

    def wire_ratio(self, kind: str, peer: PeerAddress) -> float:
        """Learned wire/raw ratio of what the `kind` sender sends to `peer`."""
        transport = self._senders.get(kind)
        return transport.wire_ratio(peer) if transport is not None else 1.0

    def drain(self) -> None:
        """Forget reported transfers (the callbacks already handled them)."""
        for t in self._transports():
            t.poll_finished()
            t.poll_received()

    def _transports(self) -> list[Transport]:
        out = list(self._senders.values())
        if self.receiver is not None:
            out.append(self.receiver)
        return out

    # --- callbacks (transport threads) ----------------------------------------------------

    def started(self, transfer_id: int) -> None:
        """A role calls this right after ``send``: the transfer's duration starts now."""
        with self._lock:
            self._send_started[transfer_id] = time.monotonic()

    def _sent(self, kind: str, status: TransferStatus) -> None:
        with self._lock:
            self.bytes_sent += status.bytes_acked
            self.wire_bytes_sent += status.wire_bytes
            t0 = self._send_started.pop(status.transfer_id, None)
        role = self._worker.role.value
        if t0 is not None:
            _TRANSFER_SECONDS.labels(role, kind).observe(time.monotonic() - t0)
        _TRANSFER_BYTES.labels(role, kind).inc(status.bytes_acked)
        _WIRE_BYTES.labels(role, kind).inc(status.wire_bytes)
        _TRANSFERS.labels(role, kind, status.state.value).inc()
        if self._on_sent is not None:
            self._on_sent(status)

    def _received(self, result: InboundResult) -> None:
        with self._lock:
            self.bytes_received += result.bytes_received
        if result.internal_error:
            _INTERNAL_ERRORS.labels(self._worker.role.value).inc()
        if result.state is TransferState.FAILED:  # P's log has only the ack; this says why
            log.warning(  # the kv_id alone: the wire id carries the landing key
                "inbound KV of %s failed after %d chunks (%d bytes): %s",
                split_wire_id(result.request_id)[0], result.chunks, result.bytes_received,
                result.reason,
            )  # fmt: skip
        if self._on_received is not None:
            self._on_received(result)
