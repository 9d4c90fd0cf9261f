"""What every transport shares: ids, the two ledgers, deadlines, and the public plumbing.

A concrete transport implements `_submit` (queue a planned transfer toward a peer),
`_send_cancel` (tell the peer to drop a transfer), `_start_io`/`_close_io` (its threads) and
`_io_threads` (for leak checks). Lifecycle: construct -> start() -> send/poll/cancel from any
thread -> close(), which fails what is still open, then joins every thread it started.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from abc import abstractmethod
from collections.abc import Callable

from pdd.config.transfer import TransferConfig
from pdd.errors import InvalidRequestError, TransferError
from pdd.transfer.api import (
    FaultHooks,
    InboundResult,
    LinkEstimate,
    PeerAddress,
    ReceiverHooks,
    SendRequest,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
    TransportStats,
)
from pdd.transfer.codec import NAME_OF, CodecId, WireRatios, codec_id
from pdd.transfer.estimate import CodecLoad
from pdd.transfer.ledger import InboundLedger, OutboundLedger, OutRecord, Reaper
from pdd.transfer.wire import (
    CancelReason,
    ChunkHeader,
    default_checksum_algo,
    encode_chunk,
    plan_chunks,
)


class BaseTransport(Transport):
    supports_codecs = True  # False: only raw payloads (a codec in a SendRequest is refused)

    def __init__(
        self,
        config: TransferConfig | None = None,
        hooks: ReceiverHooks | None = None,
        faults: FaultHooks | None = None,
        on_finished: Callable[[TransferStatus], None] | None = None,
    ):
        self.config = config or TransferConfig()
        self.hooks = hooks
        self.faults = faults or FaultHooks()
        # Transfer ids: a random 32-bit prefix per transport instance, then a counter, so ids
        # from different senders never collide at a receiver.
        self.sender_id = random.getrandbits(63)
        self._ids = itertools.count((random.getrandbits(31) << 32) + 1)
        self.checksum_algo = default_checksum_algo(self.config.checksum)
        self.wire_ratios = WireRatios()
        self.outbound = OutboundLedger(on_finished)
        self.inbound = InboundLedger(hooks, self.config.inbound_grace_s) if hooks else None
        self._reaper = Reaper(self.kind, self._tick)
        self._state_lock = threading.Lock()
        self._started = False
        self._closed = False

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        with self._state_lock:
            if self._started:
                return
            if self._closed:
                raise TransferError(f"{self.kind} transport is closed")
            self._started = True
        self._start_io()
        self._reaper.start()

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        self.outbound.stop_where(lambda r: True, TransferState.FAILED, "transport closed")
        if started:
            self._close_io()
            self._reaper.close()
        if self.inbound is not None:
            self.inbound.stop_where(lambda r: True, TransferState.FAILED, "transport closed")

    # --- sending ---------------------------------------------------------------------------

    def send(self, peer: PeerAddress, request: SendRequest) -> TransferHandle:
        if not self._started or self._closed:
            raise TransferError(f"{self.kind} transport is not running")
        self._retire_moved(peer)
        codec = self._codec_for(peer, request)
        tid = next(self._ids)
        chunks = plan_chunks(tid, request, self._chunk_bytes(peer), self.checksum_algo, codec)
        deadline_s = request.deadline_s or self.config.deadline_s
        rec = OutRecord(
            transfer_id=tid,
            request_id=request.request_id,
            peer=peer.key(),
            chunks=chunks,
            pins=list(request.segments),
            deadline=time.monotonic() + deadline_s,
            bytes_total=chunks.total,
        )
        self.outbound.open(rec)
        self._submit(peer, rec)
        return TransferHandle(self, tid, request.request_id)

    def _codec_for(self, peer: PeerAddress, request: SendRequest) -> CodecId:
        """The request's codec, else `transfer.wan_codec_peers[peer]`, else `wan_codec`."""
        name = request.codec
        if name is None:
            if not self.supports_codecs:
                return CodecId.NONE
            name = self.config.wan_codec_peers.get(peer.key(), self.config.wan_codec)
        try:
            codec = codec_id(name)
        except TransferError as exc:
            raise InvalidRequestError(str(exc), param="codec") from None
        if codec is not CodecId.NONE and not self.supports_codecs:
            raise InvalidRequestError(
                f"the {self.kind} transport sends raw KV only (codec {name!r})", param="codec"
            )
        return codec

    def _wire_payload(
        self, rec: OutRecord, index: int
    ) -> tuple[ChunkHeader, memoryview, memoryview]:
        """(header as sent, the payload to checksum, the payload to send) of chunk `index`:
        encoded on the calling transport thread (inside begin_chunk/end_chunk: the source is
        pinned); the last differs from the second only under the fault hooks."""
        t0 = time.thread_time()
        header, payload = encode_chunk(rec.chunks[index])
        cpu_s = time.thread_time() - t0
        self.wire_ratios.observe(CodecId(header.codec), header.nbytes, payload.nbytes, cpu_s)
        sent = payload
        shorten = self.faults.shorten
        if header.codec != CodecId.NONE and shorten is not None and shorten(header):
            payload = sent = payload[: payload.nbytes // 2]
            header = dataclasses.replace(header, wire_nbytes=payload.nbytes)
        corrupt = self.faults.corrupt
        if corrupt is not None and header.nbytes and corrupt(header):
            sent = memoryview(bytearray(payload))  # fault injection: flip one byte
            sent[0] ^= 0xFF
        self.outbound.count_wire(rec.transfer_id, header.wire_nbytes)
        return header, payload, sent

    def wire_ratio(self, peer: PeerAddress | None = None) -> float:
        """Learned wire/raw byte ratio of the codec `peer` (else the default) gets: 1.0 raw."""
        if not self.supports_codecs:
            return 1.0
        return self.wire_ratios.ratio(self._peer_codec(peer))

    def codec_load(self, peer: PeerAddress) -> CodecLoad | None:
        """What encoding for `peer` costs, as measured (None: it gets raw KV)."""
        codec = self._peer_codec(peer) if self.supports_codecs else CodecId.NONE
        if codec is CodecId.NONE:
            return None
        ratios = self.wire_ratios
        return CodecLoad(NAME_OF[codec], ratios.encode_bps(codec), ratios.ratio(codec))

    def _peer_codec(self, peer: PeerAddress | None) -> CodecId:
        name = self.config.wan_codec
        if peer is not None:
            name = self.config.wan_codec_peers.get(peer.key(), name)
        return codec_id(name)

    def poll(self, transfer_id: int) -> TransferStatus:
        return self.outbound.poll(transfer_id)

    def wait(self, transfer_id: int, timeout_s: float) -> TransferStatus:
        return self.outbound.wait(transfer_id, timeout_s)

    def cancel(self, transfer_id: int) -> None:
        self._abort(transfer_id, TransferState.CANCELLED, "cancelled by owner")

    def defer(self, transfer_id: int) -> None:
        rec = self.outbound.get(transfer_id)
        if rec is not None:
            rec.background = True  # read by the sender's scheduler (TCP: PeerLink.take)

    def _abort(self, transfer_id: int, state: TransferState, reason: str) -> None:
        """Stop one transfer and tell the peer, so both sides release promptly."""
        rec = self.outbound.get(transfer_id)
        if rec is None:
            return
        was_sent = rec.state is not TransferState.PENDING
        if self.outbound.stop(transfer_id, state, reason) and was_sent:
            why = CancelReason.OWNER if state is TransferState.CANCELLED else CancelReason.DEADLINE
            self._send_cancel(rec.peer, transfer_id, why)

    def _tick(self, now: float) -> None:
        for tid in self.outbound.open_ids():
            rec = self.outbound.get(tid)
            if rec is not None and rec.deadline <= now:
                self._abort(tid, TransferState.FAILED, "deadline exceeded")
        if self.inbound is not None:
            self.inbound.expire(now)

    def poll_finished(self) -> list[TransferStatus]:
        return self.outbound.drain_finished()

    def poll_received(self) -> list[InboundResult]:
        return self.inbound.drain() if self.inbound is not None else []

    def link_estimate(self, peer: PeerAddress) -> LinkEstimate | None:
        return None

    def queued_bytes(self) -> dict[str, int]:
        return self.outbound.queued_bytes()

    def stats(self) -> TransportStats:
        open_out, pinned = self.outbound.counts()
        open_in, lent = self.inbound.counts() if self.inbound is not None else (0, 0)
        threads = sum(t.is_alive() for t in self._io_threads())
        threads += self._reaper.thread.is_alive()
        bugs = self.inbound.internal_errors if self.inbound is not None else 0
        return TransportStats(open_out, pinned, open_in, lent, threads, bugs)

    # --- what a transport provides ---------------------------------------------------------

    def _chunk_bytes(self, peer: PeerAddress) -> int:
        return self.config.chunk_bytes

    @abstractmethod
    def _submit(self, peer: PeerAddress, record: OutRecord) -> None: ...

    @abstractmethod
    def _send_cancel(self, peer_key: str, transfer_id: int, reason: CancelReason) -> None: ...

    def _retire_moved(self, peer: PeerAddress) -> None:
        """Before a send: a cached connection to ``peer.key()`` that reaches another address
        (the worker of that name restarted elsewhere) must not carry it. Default: none cached."""

    @abstractmethod
    def _start_io(self) -> None: ...

    @abstractmethod
    def _close_io(self) -> None: ...

    @abstractmethod
    def _io_threads(self) -> list[threading.Thread]: ...
