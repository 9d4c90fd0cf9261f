"""In-process transport: the reference implementation of the contract, for unit tests.

Receivers register under a name in a process-wide registry; one sender thread copies chunks
straight from the source buffers into the buffers the receiver's allocator lends, round-robin
over open transfers, with the same checksums, fault hook, cancel and deadline paths as the
network transports. Closing a receiver makes later chunks fail like a dead peer; closing a
sender fails the receiver's transfers from it, like a dropped connection.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque

from pdd.transfer.api import PeerAddress, TransferState
from pdd.transfer.base import BaseTransport
from pdd.transfer.codec import CodecId
from pdd.transfer.ledger import OutRecord, cancel_outcome, land_chunk
from pdd.transfer.wire import AckStatus, CancelReason, checksum

_REGISTRY: dict[str, InprocTransport] = {}
_REGISTRY_LOCK = threading.Lock()


class InprocTransport(BaseTransport):
    kind = "inproc"

    def __init__(self, *args, name: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = name or f"inproc-{self.sender_id:x}"
        self._queue: deque[tuple[str, OutRecord, int]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-send", daemon=True)

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(host="inproc", port=0, name=self.name)

    def _start_io(self) -> None:
        if self.inbound is not None:
            with _REGISTRY_LOCK:
                _REGISTRY[self.name] = self
        self._thread.start()

    def _close_io(self) -> None:
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self.name) is self:
                del _REGISTRY[self.name]
            peers = list(_REGISTRY.values())
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        for peer in peers:  # like a dropped connection: the peers forget our transfers
            if peer.inbound is not None:
                peer.inbound.stop_where(
                    lambda r: r.source == self.sender_id, TransferState.FAILED, "sender closed"
                )

    def _io_threads(self) -> list[threading.Thread]:
        return [self._thread]

    def _submit(self, peer: PeerAddress, record: OutRecord) -> None:
        with self._cond:
            self._queue.append((peer.key(), record, 0))
            self._cond.notify()

    def _send_cancel(self, peer_key: str, transfer_id: int, reason: CancelReason) -> None:
        peer = _lookup(peer_key)
        if peer is not None and peer.inbound is not None:
            peer.inbound.stop(transfer_id, *cancel_outcome(reason))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    self._queue.clear()
                    return
                peer_key, rec, index = self._queue.popleft()
            if self._send_chunk(peer_key, rec, index) and index + 1 < len(rec.chunks):
                with self._cond:  # round-robin: the next chunk goes to the back of the line
                    self._queue.append((peer_key, rec, index + 1))

    def _send_chunk(self, peer_key: str, rec: OutRecord, index: int) -> bool:
        """Copy one chunk into the peer's buffer; False when the transfer stopped."""
        if self.outbound.begin_chunk(rec.transfer_id) is None:
            return False
        try:
            peer = _lookup(peer_key)
            if peer is None or peer.inbound is None:
                self.outbound.stop(rec.transfer_id, TransferState.FAILED, "peer unreachable")
                return False
            left_ms = max(0, int((rec.deadline - time.monotonic()) * 1000))
            header, clean, payload = self._wire_payload(rec, index)
            header = dataclasses.replace(
                header, checksum=checksum(header.checksum_algo, clean), deadline_ms=left_ms
            )
            status = peer.deliver(header, payload, self.sender_id)
            self.outbound.ack(rec.transfer_id, status, header.nbytes)
            return status is AckStatus.OK
        finally:
            self.outbound.end_chunk(rec.transfer_id)

    def deliver(self, header, payload, source: int) -> AckStatus:
        """Receiver side of one chunk: allocate, copy, verify, decode (on the sender's thread)."""
        assert self.inbound is not None
        if self._closed:  # closed between the sender's lookup and now: like a dead peer
            return AckStatus.GONE
        buf, status = self.inbound.begin_chunk(header, source)
        if buf is None:
            return status
        coded = header.codec != CodecId.NONE
        land = memoryview(bytearray(payload)) if coded else buf
        if not coded:
            buf[:] = payload
        if checksum(header.checksum_algo, land) != header.checksum:
            reason = f"integrity check failed on chunk {header.chunk_index}"
            return self.inbound.end_chunk(header.transfer_id, 0, AckStatus.CHECKSUM, reason)
        return land_chunk(self.inbound, header, land, buf)


def _lookup(name: str) -> InprocTransport | None:
    with _REGISTRY_LOCK:
        return _REGISTRY.get(name)
