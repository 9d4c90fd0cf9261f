"""UCX transport (ucxx) for P -> RelayDecode inside a datacenter.

Endpoints, cached per peer: a control endpoint to the peer's listener (sockaddr, with UCX
error handling, so a dead peer is reported) and a data endpoint. On the same host (equal
`host_id`) the data endpoint is built from the peer's worker address without error handling,
which is what lets UCX pick shared memory (7.8-10.4 GiB/s measured here; sockaddr endpoints
always use TCP). Across hosts the control endpoint carries the data too, over whatever
UCX_TLS allows (RDMA where the hardware has it).

Messages are tagged (top 2 bits = kind):

    HDR   sender -> receiver  sender id + a DATA or CANCEL frame (wire.py), on the data ep
    DATA  sender -> receiver  one chunk payload; tag mixes (transfer id, chunk index)
    ACK   receiver -> sender  an ACK frame, on the control endpoint

Connect: the receiver stream-sends a fresh challenge (a nonce) on the control endpoint; the
sender answers with its id (and, with a worker token, its proof for that nonce: ucx_auth) and
waits for the receiver's stream reply before sending headers, so the
receiver always knows which control endpoint belongs to a header's sender (acks go back on it;
its failure fails that sender's transfers) and refuses a sender without the credential.
All UCX calls run on the `UcxLoop` thread.
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from pdd.transfer.api import PeerAddress, TransferState
from pdd.transfer.base import BaseTransport
from pdd.transfer.ledger import OutRecord
from pdd.transfer.ucx_auth import PROOF_WORDS, hello_proof, kv_token
from pdd.transfer.ucx_loop import (
    ACK_TAG,
    HDR_TAG,
    KIND_MASK,
    Array,
    UcxLoop,
    close_endpoint,
    data_tag,
    process_identity,
    ucx,
)
from pdd.transfer.ucx_recv import UcxReceiver
from pdd.transfer.wire import (
    BODY_SIZE,
    PREFIX,
    FrameKind,
    checksum,
    pack_bye,
    pack_cancel,
    unpack_ack,
    unpack_prefix,
)

ACK_POSTS = 8
BYE_FLUSH_S = 0.5
_ID = struct.Struct("<Q")
ACK_BYTES = PREFIX.size + BODY_SIZE[FrameKind.ACK]
log = logging.getLogger(__name__)


def host_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


class UcxPeer:
    """Sender-side state toward one receiver (lives on the I/O thread)."""

    _serials = itertools.count()

    def __init__(self, peer: PeerAddress):
        self.serial = next(UcxPeer._serials)
        self.peer = peer
        self.key = peer.key()
        self.ctrl: Any = None
        self.data: Any = None
        self.ready = False
        self.broken: str | None = None
        self.work: deque[tuple[OutRecord, int]] = deque()
        self.inflight = 0  # chunks posted and not yet acknowledged (the window)


class UcxTransport(BaseTransport):
    kind = "ucx"
    supports_codecs = False  # the P -> RLD path inside a datacenter stays raw

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loop = UcxLoop("ucx", self.config.ucx_progress_timeout_ms)
        self.loop.on_error = self._loop_error
        self.loop.on_tick = self._check_alive
        self.host_id = host_id()
        self.token = kv_token()  # fleet credential: senders prove it, receivers require it
        self._peers: dict[str, UcxPeer] = {}
        # transfer id -> (peer, unacknowledged chunks): acks of transfers that already
        # ended (cancelled, failed) must still reopen the peer's window
        self._unacked: dict[int, list] = {}
        self._receiver = UcxReceiver(self) if self.inbound is not None else None
        self._worker_address = self.loop.worker.address.tobytes()

    @property
    def address(self) -> PeerAddress:
        port = self._receiver.port if self._receiver is not None else 0
        return PeerAddress(
            host=self.config.listen_host,
            port=port,
            ucx_address=self._worker_address,
            host_id=self.host_id,
        )

    def _check_alive(self) -> None:
        for p in list(self._peers.values()):
            if p.broken is None and p.ctrl is not None and not p.ctrl.alive:
                self._break(p, "receiver connection lost")
        if self._receiver is not None:
            self._receiver.check_alive()

    def _loop_error(self, exc: BaseException) -> None:
        log.error("ucx transport callback failed", exc_info=exc)

    def _start_io(self) -> None:
        if self._receiver is not None:
            self._receiver.listen()
        for _ in range(ACK_POSTS):
            self._post_ack_recv()
        self.loop.start()

    def _close_io(self) -> None:
        def teardown() -> None:
            for p in list(self._peers.values()):
                self._say_bye(p)
            for p in list(self._peers.values()):
                self._break(p, "transport closed")
            if self._receiver is not None:
                self._receiver.close()

        self.loop.call(teardown)
        self.loop.close()
        # Free UCX objects by reference count in a safe order (requests, endpoints,
        # listener, worker, context); left to the cycle collector, the order is arbitrary
        # and ucxx crashes when a worker goes before its endpoints.
        self._peers.clear()
        if self._receiver is not None:
            self._receiver.release()
        self.loop.release()

    def _io_threads(self) -> list[threading.Thread]:
        return [self.loop.thread, self.loop.helper]

    def _chunk_bytes(self, peer: PeerAddress) -> int:
        return self.config.ucx_chunk_bytes

    # --- sending (all below runs on the I/O thread unless noted) ---------------------------

    def _submit(self, peer: PeerAddress, record: OutRecord) -> None:  # any thread
        self.loop.call(lambda: self._enqueue(peer, record))

    def _send_cancel(self, peer_key: str, transfer_id: int, reason) -> None:  # any thread
        def cancel() -> None:
            p = self._peers.get(peer_key)
            if p is not None and p.ready and p.broken is None and p.ctrl.alive:
                frame = _ID.pack(self.sender_id) + pack_cancel(transfer_id, reason)
                self.loop.send(p.data, np.frombuffer(frame, np.uint8), HDR_TAG, lambda e: None)

        self.loop.call(cancel)

    def _enqueue(self, peer: PeerAddress, rec: OutRecord) -> None:
        p = self._peers.get(peer.key())
        if p is None or p.broken is not None:
            p = self._connect(peer)
        if p.broken is not None:
            self.outbound.stop(rec.transfer_id, TransferState.FAILED, p.broken)
            return
        p.work.append((rec, 0))
        self._pump(p)

    def _connect(self, peer: PeerAddress) -> UcxPeer:
        p = self._peers[peer.key()] = UcxPeer(peer)
        try:
            p.ctrl = ucx.UCXEndpoint.create(self.loop.worker, peer.host, peer.port, True)
            # Called from inside UCX progress: defer, closing endpoints there deadlocks. The
            # callback names the peer by key and serial, never by object: an endpoint
            # reachable from its own callback is a cycle the collector frees too late.
            key, serial = p.key, p.serial
            p.ctrl.set_close_callback(lambda: self.loop.call(lambda: self._lost(key, serial)))
            if peer.ucx_address and peer.host_id == self.host_id:
                addr = ucx.UCXAddress.create_from_buffer(peer.ucx_address)
                p.data = self.loop.worker.create_endpoint_from_worker_address(addr, False)
            else:
                p.data = p.ctrl
        except Exception as exc:  # ucxx raises its own error types
            p.broken = f"cannot connect to {p.key}: {exc}"
            return p
        # sender id, then pid and pid namespace: with shared memory the receiver checks that
        # we are alive before it matches our rendezvous (see process_alive)
        ident = process_identity(p.data is not p.ctrl)
        challenge = np.zeros(PROOF_WORDS, np.uint64)  # the receiver's nonce for this endpoint

        def on_challenge(error: str | None) -> None:
            if error is not None:
                self._break(p, f"handshake with {p.key} failed: {error}")
                return
            proof = hello_proof(self.token, self.sender_id, challenge.tobytes())
            hello = np.array([self.sender_id, *ident, *proof], np.uint64)
            self.loop.track(p.ctrl.stream_send(Array(hello)), lambda e: None, hello)
            self.loop.track(p.ctrl.stream_recv(Array(welcome)), on_welcome, welcome)

        welcome = np.zeros(1, np.uint64)

        def on_welcome(error: str | None) -> None:
            if error is not None:
                self._break(p, f"handshake with {p.key} failed: {error}")
                return
            p.ready = True
            self._pump(p)

        self.loop.track(p.ctrl.stream_recv(Array(challenge)), on_challenge, challenge)
        return p

    def _lost(self, key: str, serial: int) -> None:
        p = self._peers.get(key)
        if p is not None and p.serial == serial:
            self._break(p, "receiver connection lost")

    def _say_bye(self, p: UcxPeer) -> None:
        """Tell a live peer we are closing (ordered after our data) and let it go out."""
        if not p.ready or p.broken is not None or not p.ctrl.alive:
            return
        frame = np.frombuffer(_ID.pack(self.sender_id) + pack_bye(self.sender_id), np.uint8)
        req = p.data.tag_send(Array(frame), ucx.UCXXTag(HDR_TAG))
        deadline = time.monotonic() + BYE_FLUSH_S
        while not req.completed and time.monotonic() < deadline:
            self.loop.worker.progress_worker_event(1)

    def _pump(self, p: UcxPeer) -> None:
        """Post chunks while the peer's window has room (FIFO: oldest transfer first)."""
        if p.ctrl is not None and not p.ctrl.alive:  # never post on a failed endpoint
            self._break(p, "receiver connection lost")
            return
        window = self.config.window_chunks
        while p.ready and p.broken is None and p.work and p.inflight < window:
            rec, index = p.work.popleft()
            if index + 1 < len(rec.chunks):
                p.work.appendleft((rec, index + 1))
            self._send_chunk(p, rec, index)

    def _send_chunk(self, p: UcxPeer, rec: OutRecord, index: int) -> None:
        """Checksum the chunk on the helper thread (in posting order), then post it.

        The I/O thread keeps progressing and taking acks while the next chunks are hashed.
        """
        if self.outbound.begin_chunk(rec.transfer_id) is None:
            return
        chunk = rec.chunks[index]
        tid = rec.transfer_id
        p.inflight += 1
        self._unacked.setdefault(tid, [p, 0])[1] += 1
        algo = chunk.header.checksum_algo
        self.loop.offload(
            lambda: checksum(algo, chunk.view), lambda digest: self._post(p, rec, chunk, digest)
        )

    def _post(self, p: UcxPeer, rec: OutRecord, chunk: Any, digest: int) -> None:
        tid, header = rec.transfer_id, chunk.header

        def sent(error: str | None) -> None:
            self.outbound.end_chunk(tid)  # UCX no longer reads the source buffer
            if error is not None:
                self._break(p, f"send to {p.key} failed: {error}")

        if p.broken is not None or not p.ctrl.alive:
            sent(None if p.broken is not None else "receiver connection lost")
            return
        if rec.stop_state is not None:  # cancelled while hashing: never put it on the wire
            sent(None)
            self._window_opened(tid)  # no ack will come for it
            return
        left_ms = max(0, int((rec.deadline - time.monotonic()) * 1000))
        head = np.frombuffer(_ID.pack(self.sender_id) + header.pack_sent(digest, left_ms), np.uint8)
        payload: Any = chunk.view
        if self.faults.corrupt is not None and header.nbytes and self.faults.corrupt(header):
            payload = bytearray(payload)  # fault injection only: flip one byte in a copy
            payload[0] ^= 0xFF
        self.loop.send(p.data, head, HDR_TAG, lambda e: None, owner=p)
        if header.nbytes:
            self.loop.send(p.data, payload, data_tag(tid, header.chunk_index), sent, owner=p)
        else:
            sent(None)

    def _post_ack_recv(self) -> None:
        buf = np.zeros(ACK_BYTES, np.uint8)

        def on_ack(error: str | None) -> None:
            if error is not None:
                return  # cancelled at close
            raw = buf.tobytes()
            if unpack_prefix(raw[:8]) is FrameKind.ACK:
                tid, _index, status, nbytes = unpack_ack(raw[8:])
                self.outbound.ack(tid, status, nbytes)
                self._window_opened(tid)
            self._post_ack_recv()

        self.loop.recv(self.loop.worker, buf, ACK_TAG, KIND_MASK, on_ack)

    def _window_opened(self, tid: int) -> None:
        entry = self._unacked.get(tid)
        if entry is None:
            return
        p, _ = entry
        entry[1] -= 1
        if entry[1] == 0:
            del self._unacked[tid]
        p.inflight = max(0, p.inflight - 1)
        if p.broken is None:
            self._pump(p)

    def _break(self, p: UcxPeer, reason: str) -> None:
        """Fail everything toward `p` and close its endpoints (cancels in-flight sends)."""
        if p.broken is not None:
            return
        p.broken = reason
        p.work.clear()
        self._unacked = {t: e for t, e in self._unacked.items() if e[0] is not p}
        self.outbound.stop_where(lambda r: r.peer == p.key, TransferState.FAILED, reason)
        for ep in {id(e): e for e in (p.data, p.ctrl) if e is not None}.values():
            close_endpoint(ep)
        if reason != "transport closed":
            self.loop.abandon(p, reason)  # the peer may be dead: its requests never finish
