"""Receiving half of the UCX transport (runs on the transport's `UcxLoop` thread).

A listener accepts control endpoints; each sender introduces itself with its id (stream
message; with a worker token also its proof, checked here: ucx_auth) and gets a reply, after
which its headers are accepted; frames naming any other sender are dropped. For every DATA header the
allocator lends a buffer and a tag receive is posted for its payload; when it completes the payload is verified and an ACK goes back. Payloads of transfers we no
longer hold are received into a scratch buffer and dropped (UCX would keep them queued
otherwise). When a sender's control endpoint fails, its transfers fail and its posted
receives are abandoned (their tags are unique to that sender, which can no longer send), so
every lent buffer is released exactly once.
"""

from __future__ import annotations

import itertools
import logging
import struct
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pdd.transfer.api import TransferState
from pdd.transfer.ledger import cancel_outcome
from pdd.transfer.ucx_auth import PROOF_WORDS, new_nonce, proof_ok
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
    ack_of,
    checksum,
    read_prefix,
    unpack_cancel,
)

if TYPE_CHECKING:
    from pdd.transfer.ucx import UcxTransport

log = logging.getLogger(__name__)
HDR_POSTS = 8
FULL_MASK = (1 << 64) - 1
_ID = struct.Struct("<Q")


class UcxReceiver:
    """Endpoints are referred to by connection number, never captured in callbacks: an
    endpoint reachable from its own close callback forms a cycle that the garbage collector
    frees at an arbitrary time, and ucxx crashes when that happens after its worker."""

    def __init__(self, transport: UcxTransport):
        self.t = transport
        self.loop = transport.loop
        self.inbound = transport.inbound
        self.listener: Any = None
        self.port = 0
        self._ids = itertools.count()
        self._conns: dict[int, Any] = {}  # connection number -> control endpoint
        self._sender_of: dict[int, int] = {}  # connection number -> sender id
        self._senders: dict[int, int] = {}  # sender id -> connection number
        self._pids: dict[int, tuple[int, int]] = {}  # sender id -> (pid, pid namespace)
        self._nonces: dict[int, tuple[bytes, float]] = {}  # connection -> (challenge, sent at)
        self._closed = False
        self.refused = 0  # senders refused for a missing or wrong credential

    def listen(self) -> None:
        cfg = self.t.config
        self.listener = ucx.UCXListener.create(self.loop.worker, cfg.listen_port, self._on_conn)
        self.port = self.listener.port
        for _ in range(HDR_POSTS):
            self._post_header_recv()

    def close(self) -> None:
        """On the I/O thread: close every sender's endpoint."""
        self._closed = True
        for ep in self._conns.values():
            close_endpoint(ep)

    def release(self) -> None:
        """After the loop stopped: drop endpoints, then the listener (see UcxTransport)."""
        self._conns, self._sender_of, self._senders, self._pids = {}, {}, {}, {}
        self.listener = None

    def check_alive(self) -> None:
        """Backstop for close callbacks that UCX does not always deliver: poll `alive`,
        and the process of every shared-memory sender."""
        stale = time.monotonic() - self.t.config.first_byte_timeout_s
        for conn, (_, sent_at) in list(self._nonces.items()):
            if sent_at < stale:  # no hello in time: close it (its slot in _conns too)
                self._lost(conn)
        for conn, ep in list(self._conns.items()):
            sender = self._sender_of.get(conn)
            dead = sender is not None and not process_alive(*self._pids.get(sender, (0, 0)))
            if dead or not ep.alive:
                self._lost(conn)

    def _endpoint_of(self, sender: int) -> Any:
        conn = self._senders.get(sender)
        return self._conns.get(conn) if conn is not None else None

    def _on_conn(self, conn_request: Any) -> None:
        ep = self.listener.create_endpoint_from_conn_request(conn_request, True)
        conn = next(self._ids)
        self._conns[conn] = ep
        # UCX calls this from inside progress, where closing the endpoint would deadlock.
        ep.set_close_callback(lambda: self.loop.call(lambda: self._lost(conn)))
        if len(self._conns) > self.t.config.max_inbound_streams:
            self.refused += 1
            log.warning("UCX KV receiver full (%d senders): closed a new one", len(self._conns))
            self.loop.call(lambda: self._lost(conn))
            return
        nonce = new_nonce()
        self._nonces[conn] = (nonce, time.monotonic())
        challenge = np.frombuffer(nonce, np.uint64).copy()
        self.loop.track(ep.stream_send(Array(challenge)), lambda e: None, challenge)
        hello = np.zeros(3 + PROOF_WORDS, np.uint64)  # sender id, pid, pid ns inode, proof
        self.loop.track(
            ep.stream_recv(Array(hello)), lambda e: self._on_hello(conn, hello, e), hello
        )

    def _on_hello(self, conn: int, hello: np.ndarray, error: str | None) -> None:
        ep = self._conns.get(conn)
        if ep is None or error is not None:
            self._lost(conn)
            return
        sender = int(hello[0])
        nonce, _ = self._nonces.pop(conn, (b"", 0.0))
        if not nonce or not proof_ok(self.t.token, sender, hello[3:], nonce):
            self.refused += 1
            log.warning("refused a UCX KV sender: it did not prove the worker token")
            self._lost(conn)  # no welcome: its headers are never accepted
            return
        self._sender_of[conn], self._senders[sender] = sender, conn
        self._pids[sender] = (int(hello[1]), int(hello[2]))
        reply = np.ones(1, np.uint64)
        self.loop.track(ep.stream_send(Array(reply)), lambda e: None, reply)

    def _lost(self, conn: int) -> None:
        """A sender's connection is gone: fail its transfers, release its receives."""
        ep = self._conns.pop(conn, None)
        self._nonces.pop(conn, None)
        sender = self._sender_of.pop(conn, None)
        if sender is not None and self._senders.get(sender) == conn:
            del self._senders[sender]
            self._pids.pop(sender, None)
            self.inbound.stop_where(
                lambda r: r.source == sender, TransferState.FAILED, "sender connection lost"
            )
            if not self._closed:  # the sender may be dead: its receives never finish
                self.loop.abandon(("sender", sender), "sender connection lost")
        if ep is not None:
            close_endpoint(ep)

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
            if sender not in self._senders:  # never passed the handshake (or already gone)
                log.debug("frame from unknown sender %x dropped", sender)
                return
            kind, reads = read_prefix(raw[8 : 8 + PREFIX.size])
            body = raw[8 + PREFIX.size :]
            if kind is FrameKind.CANCEL:
                tid, reason = unpack_cancel(body[: BODY_SIZE[FrameKind.CANCEL]])
                self.inbound.stop(tid, *cancel_outcome(reason))
            elif kind is FrameKind.DATA:
                self._on_data_header(sender, ChunkHeader.unpack(body, reads))
            elif kind is FrameKind.BYE:
                self.inbound.stop_where(
                    lambda r: r.source == sender, TransferState.FAILED, "sender closed"
                )

        self.loop.recv(self.loop.worker, buf, HDR_TAG, KIND_MASK, on_header)

    def _on_data_header(self, sender: int, header: ChunkHeader) -> None:
        ep = self._endpoint_of(sender)
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
            self._ack(sender, header, status)
            return
        target = buf if buf is not None else np.empty(header.nbytes, np.uint8)

        def landed(error: str | None) -> None:
            if buf is None:
                self._ack(sender, header, status)
                return
            if error is not None:
                self.inbound.end_chunk(tid, 0, AckStatus.REFUSED, f"receive failed: {error}")
                return
            self.loop.offload(lambda: checksum(header.checksum_algo, buf), verified)

        def verified(digest: int) -> None:
            if digest != header.checksum:
                reason = f"integrity check failed: chunk {header.chunk_index} checksum mismatch"
                status = self.inbound.end_chunk(tid, 0, AckStatus.CHECKSUM, reason)
            else:
                self.inbound.verified(header)
                status = self.inbound.end_chunk(tid, header.nbytes)
            self._ack(sender, header, status)

        if not process_alive(*self._pids.get(sender, (0, 0))):
            # UCX crashes matching a shared-memory rendezvous of a dead process: never post.
            if buf is not None:
                self.inbound.end_chunk(tid, 0, AckStatus.REFUSED, "sender process gone")
            conn = self._senders.get(sender)
            if conn is not None:
                self.loop.call(lambda: self._lost(conn))
            return
        # Posted on the worker, not the endpoint: ucxx crashes when an endpoint-bound request
        # is posted while the endpoint is failing. A dead sender's receives are abandoned.
        tag = data_tag(tid, header.chunk_index)
        self.loop.recv(self.loop.worker, target, tag, FULL_MASK, landed, owner=("sender", sender))

    def _ack(self, sender: int, header: ChunkHeader, status: AckStatus) -> None:
        ep = self._endpoint_of(sender)
        if ep is None or not ep.alive:  # the sender is gone; it learns nothing more from us
            return
        frame = np.frombuffer(ack_of(header, status), np.uint8)
        self.loop.send(ep, frame, ACK_TAG, lambda e: None)
