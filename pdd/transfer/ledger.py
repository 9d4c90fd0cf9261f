"""Bookkeeping shared by every transport: who holds which buffer, and the one release path.

`OutboundLedger` owns the state machine and the pins of outbound transfers; `InboundLedger`
owns the buffers lent by the receiver's allocator. Transport threads bracket every use of a
buffer with `begin_chunk`/`end_chunk`; any stop (done, cancel, deadline, peer death, integrity
failure) only *requests* the end, and `_finalize` runs when the last thread let go of the
buffers. `_finalize` is the single release path: it drops the pins (or lent buffers),
publishes the terminal state and queues the report. Reports and callbacks run outside the lock.

    stop(reason) --busy == 0--> _finalize --> poll() terminal, poll_finished(), callback
         |                          ^
         +----- busy > 0 ---------- end_chunk() by the last thread touching the buffers

Terminal records stay readable by `poll` in a bounded recent-history map.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdd.errors import PddError, TransferCancelled, TransferError
from pdd.transfer.api import InboundResult, ReceiverHooks, TransferState, TransferStatus
from pdd.transfer.codec import CodecError, CodecId
from pdd.transfer.wire import AckStatus, CancelReason, Chunk, ChunkHeader, decode_chunk

log = logging.getLogger(__name__)

RECENT = 4096  # terminal outbound records kept for poll()
TOMBSTONES = 65536  # ids of finished inbound transfers: late chunks of them are dropped


@dataclass
class OutRecord:
    transfer_id: int
    request_id: str
    peer: str
    chunks: Sequence[Chunk]  # a ChunkPlan: computed on demand
    pins: list[Any]
    deadline: float
    bytes_total: int
    state: TransferState = TransferState.PENDING
    reason: str = ""
    bytes_acked: int = 0
    wire_bytes: int = 0  # encoded payload bytes sent so far (0: the transport counts none)
    acked: int = 0
    busy: int = 0
    stop_state: TransferState | None = None
    first_send: float = 0.0
    background: bool = False  # deferred: its chunks go when no other transfer has one waiting

    def status(self) -> TransferStatus:
        return TransferStatus(
            self.transfer_id,
            self.request_id,
            self.state,
            self.reason,
            self.bytes_total,
            self.bytes_acked,
            self.wire_bytes or self.bytes_acked,
        )


class OutboundLedger:
    """Open outbound transfers of one transport. Thread-safe."""

    def __init__(self, on_finished: Callable[[TransferStatus], None] | None = None):
        self._cond = threading.Condition()
        self._open: dict[int, OutRecord] = {}
        self._recent: OrderedDict[int, TransferStatus] = OrderedDict()
        self._finished: list[TransferStatus] = []
        self._on_finished = on_finished

    def open(self, record: OutRecord) -> None:
        with self._cond:
            self._open[record.transfer_id] = record

    def get(self, transfer_id: int) -> OutRecord | None:
        with self._cond:
            return self._open.get(transfer_id)

    def begin_chunk(self, transfer_id: int) -> OutRecord | None:
        """A thread is about to read a source buffer; None when the transfer is stopping."""
        with self._cond:
            rec = self._open.get(transfer_id)
            if rec is None or rec.stop_state is not None:
                return None
            rec.busy += 1
            if rec.state is TransferState.PENDING:
                rec.state = TransferState.TRANSFERRING
                rec.first_send = time.monotonic()
            return rec

    def end_chunk(self, transfer_id: int) -> None:
        self._settle(transfer_id, lambda rec: setattr(rec, "busy", rec.busy - 1))

    def count_wire(self, transfer_id: int, nbytes: int) -> None:
        """A chunk of `nbytes` wire bytes is about to be sent (what the link will carry)."""
        with self._cond:
            rec = self._open.get(transfer_id)
            if rec is not None:
                rec.wire_bytes += nbytes

    def ack(self, transfer_id: int, status: AckStatus, nbytes: int) -> None:
        """The receiver confirmed (or rejected) one chunk."""

        def apply(rec: OutRecord) -> None:
            if status is not AckStatus.OK:
                self._request_stop(rec, _stopped_by(status), _ack_reason(status))
                return
            rec.acked += 1
            rec.bytes_acked += nbytes
            if rec.acked == len(rec.chunks):
                self._request_stop(rec, TransferState.DONE, "")

        self._settle(transfer_id, apply)

    def stop(self, transfer_id: int, state: TransferState, reason: str) -> bool:
        """Request a terminal state; the first request wins. True if this call stopped it."""
        won = []
        self._settle(transfer_id, lambda rec: won.append(self._request_stop(rec, state, reason)))
        return bool(won and won[0])

    def stop_where(self, pred: Callable[[OutRecord], bool], state: TransferState, reason: str):
        with self._cond:
            ids = [r.transfer_id for r in self._open.values() if pred(r)]
        for tid in ids:
            self.stop(tid, state, reason)

    def expire(self, now: float) -> None:
        self.stop_where(lambda r: r.deadline <= now, TransferState.FAILED, "deadline exceeded")

    def _request_stop(self, rec: OutRecord, state: TransferState, reason: str) -> bool:
        if rec.stop_state is not None:
            return False
        rec.stop_state, rec.reason = state, reason
        return True

    def _settle(self, transfer_id: int, mutate: Callable[[OutRecord], None]) -> None:
        """Apply `mutate` under the lock, then finalize if stopped and no thread is busy."""
        with self._cond:
            rec = self._open.get(transfer_id)
            if rec is None:
                return
            mutate(rec)
            if rec.stop_state is None or rec.busy > 0:
                return
            # The one release path: drop the pins, publish the terminal state.
            del self._open[transfer_id]
            rec.state = rec.stop_state
            rec.chunks, rec.pins = [], []
            status = rec.status()
            self._recent[transfer_id] = status
            while len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            self._finished.append(status)
            self._cond.notify_all()
        if self._on_finished is not None:
            self._on_finished(status)

    def poll(self, transfer_id: int) -> TransferStatus:
        with self._cond:
            rec = self._open.get(transfer_id)
            if rec is not None:
                return rec.status()
            if transfer_id in self._recent:
                return self._recent[transfer_id]
        raise TransferError(f"unknown transfer id {transfer_id}")

    def wait(self, transfer_id: int, timeout_s: float) -> TransferStatus:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while transfer_id in self._open:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return self.poll(transfer_id)

    def drain_finished(self) -> list[TransferStatus]:
        with self._cond:
            out, self._finished = self._finished, []
            return out

    def counts(self) -> tuple[int, int]:
        """(open transfers, pinned source buffers)."""
        with self._cond:
            return len(self._open), sum(len(r.pins) for r in self._open.values())

    def queued_bytes(self) -> dict[str, int]:
        """Bytes of open transfers not yet acknowledged, per peer key; deferred transfers
        (served only when nothing else waits) are not counted."""
        out: dict[str, int] = {}
        with self._cond:
            for r in self._open.values():
                if not r.background:
                    out[r.peer] = out.get(r.peer, 0) + max(0, r.bytes_total - r.bytes_acked)
        return out

    def open_ids(self, peer: str | None = None) -> list[int]:
        with self._cond:
            return [t for t, r in self._open.items() if peer is None or r.peer == peer]


def _ack_reason(status: AckStatus) -> str:
    return {
        AckStatus.CHECKSUM: "integrity check failed: receiver got a corrupted chunk",
        AckStatus.REFUSED: "receiver refused a chunk (allocator)",
        AckStatus.GONE: "receiver no longer has the transfer (cancelled, expired or failed)",
        AckStatus.INTERNAL: "receiver hit an internal error (see its log)",
        AckStatus.CODEC: "integrity check failed: a chunk did not decode (corrupt codec frame)",
        AckStatus.CANCELLED: "receiver no longer wants the KV (its request moved on)",
    }.get(status, f"receiver answered {status.name}")


def _stopped_by(status: AckStatus) -> TransferState:
    """The state a transfer ends in when its receiver answers ``status`` (not OK)."""
    return TransferState.CANCELLED if status is AckStatus.CANCELLED else TransferState.FAILED


@dataclass
class InRecord:
    transfer_id: int
    request_id: str
    source: int
    chunk_count: int
    deadline: float
    bytes_received: int = 0
    received: int = 0
    lent: int = 0
    busy: int = 0
    stop_state: TransferState | None = None
    reason: str = ""
    cause: AckStatus = AckStatus.GONE  # what later chunks of a stopped transfer are told
    internal_error: bool = False


class InboundLedger:
    """Open inbound transfers of one receiver and the buffers its allocator lent. Thread-safe."""

    def __init__(self, hooks: ReceiverHooks, grace_s: float = 1.0):
        self._hooks = hooks
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._open: dict[int, InRecord] = {}
        # Finished transfer ids -> the status late chunks get, so every ack after a failure
        # carries its real cause (a corrupted chunk stays an integrity failure at the sender).
        self._tombstones: OrderedDict[int, AckStatus] = OrderedDict()
        self._results: list[InboundResult] = []
        self.internal_errors = 0  # allocator bugs seen (each failed its transfer)

    def begin_chunk(self, header: ChunkHeader, source: int) -> tuple[memoryview | None, AckStatus]:
        """Lend a buffer for one arriving chunk, or say why its bytes must be discarded."""
        with self._lock:
            if header.transfer_id in self._tombstones:
                return None, self._tombstones[header.transfer_id]
            rec = self._open.get(header.transfer_id)
            if rec is None:
                deadline = time.monotonic() + header.deadline_ms / 1000 + self._grace_s
                rec = InRecord(
                    header.transfer_id, header.request_id, source, header.chunk_count, deadline
                )
                self._open[header.transfer_id] = rec
            if rec.stop_state is not None:
                return None, rec.cause
            rec.busy += 1
        if header.nbytes == 0:
            return memoryview(bytearray(0)), AckStatus.OK
        try:
            buf = memoryview(self._hooks.allocate(header)).cast("B")
            if buf.readonly or buf.nbytes != header.nbytes:
                raise TransferError(f"allocator gave {buf.nbytes} bytes, need {header.nbytes}")
        except TransferCancelled as exc:  # its owner gave the KV up: cancelled, not failed
            self.end_chunk(header.transfer_id, 0, AckStatus.CANCELLED, str(exc))
            return None, AckStatus.CANCELLED
        except PddError as exc:  # a refusal: this transfer fails, the stream goes on
            self.end_chunk(
                header.transfer_id, 0, AckStatus.REFUSED, f"allocator refused chunk: {exc}"
            )
            return None, AckStatus.REFUSED
        except Exception as exc:  # a bug in the allocator: loud, and still only this transfer
            log.exception("KV receive: internal error landing chunk of %s", header.request_id)
            with self._lock:
                self.internal_errors += 1
                rec.internal_error = True
            self.end_chunk(header.transfer_id, 0, AckStatus.INTERNAL, f"internal error: {exc!r}")
            return None, AckStatus.INTERNAL
        with self._lock:
            rec.lent += 1
        return buf, AckStatus.OK

    def end_chunk(
        self, transfer_id: int, nbytes: int, failure: AckStatus = AckStatus.OK, error: str = ""
    ) -> AckStatus:
        """A thread finished writing one chunk (or failed it: `failure` != OK, with `error`)."""

        def apply(rec: InRecord) -> AckStatus:
            rec.busy -= 1
            if failure is not AckStatus.OK:
                self._request_stop(rec, _stopped_by(failure), error, failure)
                return failure
            rec.received += 1
            rec.bytes_received += nbytes
            if rec.received == rec.chunk_count:
                self._request_stop(rec, TransferState.DONE, "")
            return AckStatus.OK

        status = self._settle(transfer_id, apply)
        return AckStatus.GONE if status is None else status

    def verified(self, header: ChunkHeader) -> None:
        """The chunk's bytes are complete and passed their checksum (and decoded): tell the
        hooks (``ReceiverHooks.on_verified``). Call it before ``end_chunk`` counts the chunk,
        so it precedes the transfer's ``on_received``."""
        hook = self._hooks.on_verified
        if hook is None:
            return
        try:
            hook(header)
        except Exception:  # a receiver bug must not break the stream; the transfer goes on
            log.exception("KV receive: on_verified failed for %s", header.request_id)

    def stop(self, transfer_id: int, state: TransferState, reason: str) -> None:
        with self._lock:
            if transfer_id not in self._open:
                self._tomb(transfer_id)
                return
        self._settle(transfer_id, lambda rec: self._request_stop(rec, state, reason))

    def stop_where(self, pred: Callable[[InRecord], bool], state: TransferState, reason: str):
        with self._lock:
            ids = [r.transfer_id for r in self._open.values() if pred(r)]
        for tid in ids:
            self.stop(tid, state, reason)

    def expire(self, now: float) -> None:
        self.stop_where(lambda r: r.deadline <= now, TransferState.FAILED, "deadline exceeded")

    @staticmethod
    def _request_stop(
        rec: InRecord, state: TransferState, reason: str, cause: AckStatus = AckStatus.GONE
    ) -> None:
        if rec.stop_state is None:
            rec.stop_state, rec.reason, rec.cause = state, reason, cause

    def _tomb(self, transfer_id: int, cause: AckStatus = AckStatus.GONE) -> None:
        self._tombstones[transfer_id] = cause
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _settle(self, transfer_id: int, mutate: Callable[[InRecord], Any]) -> Any:
        with self._lock:
            rec = self._open.get(transfer_id)
            if rec is None:
                return None
            out = mutate(rec)
            if rec.stop_state is None or rec.busy > 0:
                return out
            # The one release path: forget the lent buffers, report once.
            del self._open[transfer_id]
            self._tomb(transfer_id, rec.cause)
            rec.lent = 0
            result = InboundResult(
                transfer_id,
                rec.request_id,
                rec.stop_state,
                rec.reason,
                rec.bytes_received,
                rec.received,
                rec.internal_error,
            )
            self._results.append(result)
        if self._hooks.on_received is not None:
            self._hooks.on_received(result)
        return out

    def drain(self) -> list[InboundResult]:
        with self._lock:
            out, self._results = self._results, []
            return out

    def counts(self) -> tuple[int, int]:
        """(open inbound transfers, buffers lent by the allocator and not yet reported)."""
        with self._lock:
            return len(self._open), sum(r.lent for r in self._open.values())


def land_chunk(
    inbound: InboundLedger, header: ChunkHeader, payload: Any, dest: memoryview
) -> AckStatus:
    """End a chunk whose wire payload passed its checksum: decode it into `dest` (a no-op
    for raw chunks, which landed there already). A payload that does not decode fails the
    transfer (AckStatus.CODEC): its buffers are released like any failure's and never used."""
    if header.codec != CodecId.NONE:
        try:
            decode_chunk(header, payload, dest)
        except CodecError as exc:
            reason = f"integrity check failed: chunk {header.chunk_index} does not decode: {exc}"
            return inbound.end_chunk(header.transfer_id, 0, AckStatus.CODEC, reason)
    inbound.verified(header)
    return inbound.end_chunk(header.transfer_id, header.nbytes)


def cancel_outcome(reason: CancelReason) -> tuple[TransferState, str]:
    """How a receiver reports a transfer its sender stopped."""
    if reason is CancelReason.DEADLINE:
        return TransferState.FAILED, "sender deadline exceeded"
    return TransferState.CANCELLED, "cancelled by sender"


class Reaper:
    """Calls `tick(now)` every `tick_s` on one owned thread (deadline expiry)."""

    def __init__(self, name: str, tick: Callable[[float], None], tick_s: float = 0.05):
        self._tick_fn, self._tick = tick, tick_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"{name}-reaper", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            self._tick_fn(time.monotonic())

    def close(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()
