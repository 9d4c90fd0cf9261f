"""Receiving half of the UCX transport (runs on the transport's `UcxLoop` thread).

A listener accepts control endpoints; each sender introduces itself with its id (stream
message) and gets a reply, after which its headers are accepted. For every DATA header the
allocator lends a buffer and a tag receive is posted for its payload; when it completes the payload is verified and an ACK goes back. Payloads of transfers we no
longer hold are received into a scratch buffer and dropped (UCX would keep them queued
otherwise). When a sender's control endpoint fails, its transfers fail and its posted
receives are abandoned (their tags are unique to that sender, which can no longer send), so
every lent buffer is released exactly once.
"""

from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from pdd.transfer.api import TransferState
from pdd.transfer.ledger import cancel_outcome
from pdd.transfer.ucx_loop import (
    ACK_TAG,
    HDR_TAG,
    KIND_MASK,
    Array,
    close_endpoint,
    data_tag,
    process_alive,
    ucx,
)
from pdd.transfer.wire import (
    BODY_SIZE,
    PREFIX,
    AckStatus,
    ChunkHeader,
    FrameKind,
    checksum,
    pack_ack,
    unpack_cancel,
    unpack_prefix,
)

if TYPE_CHECKING:
    from pdd.transfer.ucx import UcxTransport

log = logging.getLogger(__name__)
HDR_POSTS = 8
FULL_MASK = (1 << 64) - 1
_ID = struct.Struct("<Q")


class UcxReceiver:
    def __init__(self, transport: UcxTransport):
        self.t = transport
        self.loop = transport.loop
        self.inbound = transport.inbound
        self.listener: Any = None
        self.port = 0
        self._senders: dict[int, Any] = {}  # sender id -> its control endpoint
        self._conns: list[Any] = []
        self._lost: dict[int, Any] = {}  # id(endpoint) -> its `lost` handler
        self._pids: dict[int, tuple[int, int]] = {}  # sender id -> (pid, pid namespace)
        self._closed = False

    def listen(self) -> None:
        cfg = self.t.config
        self.listener = ucx.UCXListener.create(self.loop.worker, cfg.listen_port, self._on_conn)
        self.port = self.listener.port
        for _ in range(HDR_POSTS):
            self._post_header_recv()

    def close(self) -> None:
        """On the I/O thread: close every sender's endpoint."""
        self._closed = True
        for ep in self._conns:
            close_endpoint(ep)

    def release(self) -> None:
        """After the loop stopped: drop endpoints, then the listener (see UcxTransport)."""
        self._conns, self._senders, self._lost, self._pids = [], {}, {}, {}
        self.listener = None

    def check_alive(self) -> None:
        """Backstop for close callbacks that UCX does not always deliver: poll `alive`,
        and the process of every shared-memory sender."""
        for ep in list(self._conns):
            if not ep.alive and id(ep) in self._lost:
                self._lost[id(ep)]()
        for sender, ep in list(self._senders.items()):
            if not process_alive(*self._pids.get(sender, (0, 0))) and id(ep) in self._lost:
                self._lost[id(ep)]()

    def _on_conn(self, conn_request: Any) -> None:
        ep = self.listener.create_endpoint_from_conn_request(conn_request, True)
        self._conns.append(ep)
        hello = np.zeros(3, np.uint64)  # sender id, pid, pid namespace inode
        state: dict[str, int] = {}

        def lost() -> None:
            sender = state.get("sender")
            if sender is not None and self._senders.get(sender) is ep:
                del self._senders[sender]
                self._pids.pop(sender, None)
                self.inbound.stop_where(
                    lambda r: r.source == sender, TransferState.FAILED, "sender connection lost"
                )
            if ep in self._conns:
                self._conns.remove(ep)
            self._lost.pop(id(ep), None)
            close_endpoint(ep)
            if sender is not None:  # its posted receives can never complete: release them
                self.loop.abandon(("sender", sender), "sender connection lost")

        def on_hello(error: str | None) -> None:
            if error is not None:
                lost()
                return
            state["sender"] = sender = int(hello[0])
            self._senders[sender] = ep
            self._pids[sender] = (int(hello[1]), int(hello[2]))
            reply = np.ones(1, np.uint64)
            self.loop.track(ep.stream_send(Array(reply)), lambda e: None, reply)

        # UCX calls this from inside progress, where closing the endpoint would deadlock.
        ep.set_close_callback(lambda: self.loop.call(lost))
        self._lost[id(ep)] = lost
        self.loop.track(ep.stream_recv(Array(hello)), on_hello, hello)

    def _post_header_recv(self) -> None:
        if self._closed:
            return
        buf = np.zeros(8 + PREFIX.size + BODY_SIZE[FrameKind.DATA], np.uint8)

        def on_header(error: str | None) -> None:
            if error is not None:
                return  # cancelled at close
            self._post_header_recv()
            raw = buf.tobytes()
            sender = _ID.unpack_from(raw)[0]
            kind = unpack_prefix(raw[8 : 8 + PREFIX.size])
            body = raw[8 + PREFIX.size :]
            if kind is FrameKind.CANCEL:
                tid, reason = unpack_cancel(body[: BODY_SIZE[FrameKind.CANCEL]])
                self.inbound.stop(tid, *cancel_outcome(reason))
            elif kind is FrameKind.DATA:
                self._on_data_header(sender, ChunkHeader.unpack(body))
            elif kind is FrameKind.BYE:
                self.inbound.stop_where(
                    lambda r: r.source == sender, TransferState.FAILED, "sender closed"
                )

        self.loop.recv(self.loop.worker, buf, HDR_TAG, KIND_MASK, on_header)

    def _on_data_header(self, sender: int, header: ChunkHeader) -> None:
        ep = self._senders.get(sender)
        if ep is None or not ep.alive:
            # Its connection died (ucxx crashes when a request is posted on a failed
            # endpoint); `lost` fails the transfer. Nothing was lent for this chunk yet.
            log.debug("header from gone sender %x dropped", sender)
            return
        buf, status = self.inbound.begin_chunk(header, sender)
        tid = header.transfer_id
        if header.nbytes == 0:
            if buf is not None:
                status = self.inbound.end_chunk(tid, 0)
            self._ack(ep, header, status)
            return
        target = buf if buf is not None else np.empty(header.nbytes, np.uint8)

        def landed(error: str | None) -> None:
            if buf is None:
                self._ack(ep, header, status)
                return
            if error is not None:
                self.inbound.end_chunk(tid, 0, AckStatus.REFUSED, f"receive failed: {error}")
                return
            self.loop.offload(lambda: checksum(header.checksum_algo, buf), verified)

        def verified(digest: int) -> None:
            if digest != header.checksum:
                reason = f"integrity check failed: chunk {header.chunk_index} checksum mismatch"
                self._ack(ep, header, self.inbound.end_chunk(tid, 0, AckStatus.CHECKSUM, reason))
            else:
                self._ack(ep, header, self.inbound.end_chunk(tid, header.nbytes))

        if not process_alive(*self._pids.get(sender, (0, 0))):
            # UCX crashes matching a shared-memory rendezvous of a dead process: never post.
            if buf is not None:
                self.inbound.end_chunk(tid, 0, AckStatus.REFUSED, "sender process gone")
            self.loop.call(self._lost.get(id(ep), lambda: None))
            return
        # Posted on the worker, not the endpoint: ucxx crashes when an endpoint-bound request
        # is posted while the endpoint is failing. A dead sender's receives are abandoned.
        tag = data_tag(tid, header.chunk_index)
        self.loop.recv(self.loop.worker, target, tag, FULL_MASK, landed, owner=("sender", sender))

    def _ack(self, ep: Any, header: ChunkHeader, status: AckStatus) -> None:
        if not ep.alive:  # the sender is gone; it learns nothing more from us
            return
        frame = np.frombuffer(
            pack_ack(header.transfer_id, header.chunk_index, status, header.nbytes), np.uint8
        )
        self.loop.send(ep, frame, ACK_TAG, lambda e: None)
