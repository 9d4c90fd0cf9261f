"""Receiving half of the TCP transport: a listener thread and one thread per accepted stream.

A stream starts with the receiver's CHALLENGE (a fresh nonce), answered by the sender's HELLO
(its id) and AUTH (its proof of the worker token for this nonce: pdd.transfer.ucx_auth); a
receiver with a token closes a stream whose proof is wrong. The handshake (TLS included) must
finish within ``transfer.first_byte_timeout_s``, and at most ``transfer.max_inbound_streams``
streams are open at once (one more is closed on accept). Each DATA frame's payload is read straight
into the buffer the allocator lends, verified against its checksum trailer, and acknowledged
on the same socket (OK, CHECKSUM, REFUSED or GONE). Payloads of transfers the receiver no longer holds
(cancelled, failed, expired) are read and dropped. When a stream dies (EOF, reset, TLS
failure) every open transfer from that sender fails and its lent buffers are released.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from typing import TYPE_CHECKING

import numpy as np

from pdd.errors import TransferError
from pdd.transfer.api import TransferState
from pdd.transfer.codec import CodecId
from pdd.transfer.ledger import cancel_outcome, land_chunk
from pdd.transfer.tcp_io import (
    FrameReader,
    close_quietly,
    send_all,
    shutdown_quietly,
    tune,
)
from pdd.transfer.ucx_auth import new_nonce, proof_ok
from pdd.transfer.wire import (
    MAX_PROBE_BYTES,
    PROBE_ID,
    TRAILER,
    AckStatus,
    ChunkHeader,
    FrameKind,
    ack_of,
    pack_ack,
    pack_challenge,
    unpack_cancel,
    unpack_hello,
    unpack_probe,
)

if TYPE_CHECKING:
    from pdd.transfer.tcp import TcpTransport

log = logging.getLogger(__name__)


class Listener:
    def __init__(self, transport: TcpTransport):
        self.transport = transport
        cfg = transport.config
        self.sock = socket.create_server((cfg.listen_host, cfg.listen_port), backlog=128)
        self.host, self.port = self.sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._streams: list[ReceiverStream] = []
        self._closing = False
        self.thread = threading.Thread(target=self._accept_loop, name="tcp-accept", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # listener shut down by close()
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                self._streams = [s for s in self._streams if s.thread.is_alive()]
                if len(self._streams) >= self.transport.config.max_inbound_streams:
                    self.transport.refused += 1
                    log.warning("KV receiver full (%d streams): closed a new connection",
                                len(self._streams))  # fmt: skip
                    conn.close()
                    continue
                stream = ReceiverStream(self.transport, conn)
                self._streams.append(stream)
            stream.thread.start()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            streams = list(self._streams)
        shutdown_quietly(self.sock)
        self.thread.join()
        self.sock.close()
        for s in streams:
            shutdown_quietly(s.sock)
        for s in streams:
            s.thread.join()

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [self.thread] + [s.thread for s in self._streams]


class ReceiverStream:
    def __init__(self, transport: TcpTransport, conn: socket.socket):
        self.transport = transport
        self.sock: socket.socket = conn
        self.sender_id: int | None = None
        self.thread = threading.Thread(target=self._run, name="tcp-recv", daemon=True)

    def _run(self) -> None:
        reason = "connection closed"
        try:
            self._handshake()
            self._loop()
        except (OSError, TransferError, ValueError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a bug: still fail this sender's transfers below
            log.exception("receiver stream crashed")
            reason = f"receiver stream crashed: {type(exc).__name__}: {exc}"
        finally:
            if self.sender_id is not None:
                sender = self.sender_id
                self.transport.inbound.stop_where(
                    lambda r: r.source == sender,
                    TransferState.FAILED,
                    f"sender connection lost ({reason})",
                )
            close_quietly(self.sock)

    def _handshake(self) -> None:
        cfg = self.transport.config
        tune(self.sock, cfg, cfg.min_chunk_bytes)
        self.sock.settimeout(cfg.first_byte_timeout_s)  # the whole handshake, TLS included
        ctx: ssl.SSLContext | None = self.transport.server_tls
        if ctx is not None:  # a peer without a certificate from our CA fails right here
            self.sock = ctx.wrap_socket(self.sock, server_side=True)
        nonce = new_nonce()
        send_all(self.sock, [pack_challenge(nonce)])
        self.reader = FrameReader(self.sock)
        kind, body = self.reader.read_frame()
        if kind is not FrameKind.HELLO:
            raise TransferError(f"expected HELLO, got {kind.name}")
        sender = unpack_hello(body)[0]
        kind, proof = self.reader.read_frame()
        if kind is not FrameKind.AUTH:
            raise TransferError(f"expected AUTH, got {kind.name}")
        if not proof_ok(self.transport.token, sender, np.frombuffer(proof, np.uint64), nonce):
            self.transport.refused += 1
            log.warning("refused a TCP KV sender: it did not prove the worker token")
            raise TransferError("sender did not prove the worker token")
        self.sock.settimeout(None)
        self.sender_id = sender

    def _loop(self) -> None:
        inbound = self.transport.inbound
        while True:
            kind, body = self.reader.read_frame()
            if kind is FrameKind.DATA:
                self._chunk(ChunkHeader.unpack(body, self.reader.sender_reads))
            elif kind is FrameKind.CANCEL:
                tid, reason = unpack_cancel(body)
                inbound.stop(tid, *cancel_outcome(reason))
            elif kind is FrameKind.PROBE:  # a link's warm-up: drop the bytes, ack them
                nbytes = unpack_probe(body)
                if nbytes > MAX_PROBE_BYTES:
                    raise TransferError(f"probe of {nbytes} bytes (at most {MAX_PROBE_BYTES})")
                self.reader.skip(nbytes)
                send_all(self.sock, [pack_ack(PROBE_ID, 0, AckStatus.OK, nbytes)])
            else:
                raise TransferError(f"unexpected {kind.name} frame from sender")

    def _chunk(self, header: ChunkHeader) -> None:
        inbound = self.transport.inbound
        tid = header.transfer_id
        buf, status = inbound.begin_chunk(header, self.sender_id)
        wire = header.wire_size
        if buf is None:
            self.reader.skip(wire + TRAILER.size)
        else:
            coded = header.codec != CodecId.NONE  # encoded: land the wire bytes aside first
            land = memoryview(bytearray(wire)) if coded else buf
            try:
                crc = self.reader.readinto(land, header.checksum_algo)
                sent_crc = TRAILER.unpack(self.reader.read(TRAILER.size))[0]
            except BaseException:
                inbound.end_chunk(tid, 0, AckStatus.REFUSED, "connection lost mid-chunk")
                raise
            if crc != sent_crc:
                reason = f"integrity check failed: chunk {header.chunk_index} checksum mismatch"
                status = inbound.end_chunk(tid, 0, AckStatus.CHECKSUM, reason)
            else:
                status = land_chunk(inbound, header, land, buf)
        send_all(self.sock, [ack_of(header, status)])
