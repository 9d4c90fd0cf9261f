"""Sending half of the TCP transport: one `PeerLink` per receiver, N `SenderStream`s each.

A link owns a queue of planned chunks (references into pinned source buffers, never copies)
and a queue of control frames (CANCEL). Each stream is one thread that owns one socket, so a
TLS socket is never used by two threads. Its loop:

    drain ready ACKs -> window open? send a control frame, else the next chunk -> else sleep
    on (socket readable | wake pipe)

Open transfers share the link chunk by chunk, the one with the fewest bytes left first
(shortest remaining first: the least waiting in all), so a two-block transfer submitted
behind a 1 GiB one waits only for the chunks already in flight, not for the gigabyte, nor for
half the link while it crosses as round robin made it; a lone transfer has every stream to
itself. A run of small transfers holds a large one back only while it lasts.
A deferred transfer (``Transport.defer``: nobody waits for it) moves to a second queue that is
served only while the first is empty, so it takes what the link has left; what it already has
in flight (at most the window) is all a new transfer finds ahead of it.
Within a transfer chunks leave in block order, so they land in prefix order. The link follows
its `FlowPlan` (`pdd.transfer.estimate.plan_flow`, re-planned at most every RTT_REFRESH_S
from its estimate): at most `plan.stream_window_bytes` per stream are unacknowledged, counted
in bytes, not chunks (a transfer is cut into chunks when it is submitted; the first to a new
peer, cut before any estimate, has the smallest, and a window counted in chunks held it near
the starting rate however far the plan grew), and a path whose bandwidth-delay product needs
more streams than the link has opens them. Any socket error breaks the whole link: every open
transfer to that peer fails, the link's threads exit, and the next send opens a fresh link.

Warm-up (``PeerLink.warm``, from WarmKv): a link's first transfer would pay its connections'
set-up (TCP, TLS, the token's challenge: ~3 RTTs before a byte of KV) and the ramp of a plan
that starts from nothing measured (measured on the lab at 1 Gbit/s x 40 ms: 45-53% of the link
over a first 64 MiB; 83-95% once 4-16 MiB had crossed). So before any request the link
connects its streams and sends PROBE frames (bytes the receiver drops and acks) when nothing
else waits, as the lowest class after deferred transfers, until its delivery rate grew by
less than PROBE_GROWTH for PROBE_FLAT intervals in a row (the path, not the window, limits it;
BBR leaves its start-up the same way) or ``transfer.warmup_bytes`` went out. The estimate and
the sockets' congestion state stay with the link for the first real transfer. Only a receiver
whose address says it drops PROBE frames (``PeerAddress.probes``, set by this version's
receivers) is probed: an older one would close the connection, and with it every transfer on
the link (a rolling upgrade moves P before MD). An idle WAN
stream then sends an empty PROBE every ``transfer.keep_warm_s`` (not counted in the estimate):
the congestion control keeps a fresh view of the path (BBR re-measures its minimum RTT every
10 s and holds the window at 4 packets for 200 ms when that falls due at a transfer's start;
a keep-warm ack takes that turn while idle). Measured on the lab after 30 s idle: a warmed
link's first 64 MiB in 604-622 ms with it, 670-687 ms without (the link's rate: 537 ms).
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdd.errors import TransferError
from pdd.transfer.api import PeerAddress, TransferState
from pdd.transfer.estimate import (
    CHUNK_LOOP_RTTS,
    LAN_RTT_S,
    FlowPlan,
    LinkEstimator,
    plan_flow,
)
from pdd.transfer.ledger import OutRecord
from pdd.transfer.tcp_io import (
    SLICE,
    FrameReader,
    close_quietly,
    kernel_rtt_s,
    send_all,
    shutdown_quietly,
    tune,
)
from pdd.transfer.ucx_auth import hello_proof
from pdd.transfer.wire import (
    MAX_PROBE_BYTES,
    PROBE_ID,
    TRAILER,
    FrameKind,
    Hasher,
    pack_auth,
    pack_cancel,
    pack_hello,
    pack_probe,
    unpack_ack,
)

if TYPE_CHECKING:
    from pdd.transfer.tcp import TcpTransport

RTT_REFRESH_S = 0.05
PROBE_GROWTH = 1.25  # a warm-up goes on while its delivery rate grows by this per interval
PROBE_FLAT = 5  # intervals in a row that did not: the path is full, the warm-up ends
PROBE_INTERVAL_S = 0.05  # an interval lasts this or an RTT, whichever is longer
_ZEROS = memoryview(bytes(1 << 20))  # what a PROBE carries
log = logging.getLogger(__name__)


@dataclass
class _Probe:
    """A link's warm-up under way (module doc). It judges the path by its own acks' rate over
    intervals of an RTT, at least PROBE_INTERVAL_S (the link's estimate is smoothed, and lags
    a ramp). PROBE_FLAT intervals leave the senders' TCP the rounds it needs to see the path
    full too (BBR: 3 rounds, then it drains its queue), so the first transfer does not start
    in TCP's start-up, which overshoots the bottleneck's queue."""

    left: int  # bytes it may still send
    started: float
    sent: int = 0
    unacked: int = 0  # probe chunks on the wire
    best_bps: float = 0.0
    flat: int = 0  # intervals in a row that did not beat best_bps by PROBE_GROWTH
    t0: float | None = None  # when the current interval began (its first ack)
    acked: int = 0  # bytes acked since t0

    def on_ack(self, nbytes: int, now: float, rtt_s: float) -> None:
        self.unacked -= 1
        if self.t0 is None:
            self.t0, self.acked = now, 0
            return
        self.acked += nbytes
        if now - self.t0 < max(PROBE_INTERVAL_S, rtt_s):
            return
        rate = self.acked * 8 / (now - self.t0)
        self.t0, self.acked = now, 0
        if rate > self.best_bps * PROBE_GROWTH:
            self.best_bps, self.flat = rate, 0
            return
        self.best_bps = max(self.best_bps, rate)
        self.flat += 1
        if self.flat >= PROBE_FLAT:
            self.left = 0


class PeerLink:
    def __init__(self, transport: TcpTransport, peer: PeerAddress):
        self.transport = transport
        self.peer = peer
        self.key = peer.key()
        self.estimator = LinkEstimator()
        self._lock = threading.Lock()
        self._work: deque[tuple[OutRecord, int]] = deque()
        self._deferred: deque[tuple[OutRecord, int]] = deque()  # served when _work is empty
        self._control: deque[bytes] = deque()
        self.broken: str | None = None
        self.plan = plan_flow(None, transport.config, transport.socket_bytes)
        self._planned_at = 0.0
        n = self.plan.streams
        self.streams = [SenderStream(self, i, n) for i in range(n)]  # replaced, never mutated
        self._started = False
        self._probe: _Probe | None = None  # the warm-up under way

    def warm(self, budget_bytes: int) -> bool:
        """Probe this link (module doc) unless it was measured, is being probed or is broken,
        or its receiver does not say it drops PROBE frames. Returns whether a probe started."""
        est = self.estimator.estimate()
        with self._lock:
            if budget_bytes <= 0 or self.broken is not None or self._probe is not None:
                return False
            if not self.peer.probes:  # an older receiver: a PROBE would break the link
                return False
            if est is not None and est.samples > 0:
                return False
            self._probe = _Probe(budget_bytes, time.monotonic())
        self._wake_all()
        return True

    @property
    def warming(self) -> bool:
        """A warm-up is under way (bytes to send or acks to come)."""
        with self._lock:
            return self._probe is not None and self.broken is None

    def probe_acked(self, nbytes: int, now: float) -> None:
        est = self.estimator.estimate()
        with self._lock:
            probe = self._probe
            if probe is None:
                return
            probe.on_ack(nbytes, now, est.rtt_s if est else 0.0)
            if probe.left > 0 or probe.unacked > 0:
                return
            self._probe = None
        log.info("link to %s warmed up: %.1f MiB probed in %.0f ms (%s)", self.key,
                 probe.sent / 2**20, (time.monotonic() - probe.started) * 1000, est)  # fmt: skip

    def start(self) -> None:
        with self._lock:
            self._started = True
            streams = self.streams
        for s in streams:
            s.thread.start()

    def replan(self, now: float) -> FlowPlan:
        """The link's plan, recomputed from its estimate at most every RTT_REFRESH_S; opens
        the streams a larger plan asks for."""
        with self._lock:
            if now - self._planned_at < RTT_REFRESH_S or self.broken is not None:
                return self.plan
            self._planned_at = now
            old = self.plan
            cfg = self.transport.config
            self.plan = plan = plan_flow(
                self.estimator.estimate(),
                cfg,
                self.transport.socket_bytes,
                self.transport.codec_load(self.peer),
            )
            added = [SenderStream(self, i, plan.streams) for i in range(len(self.streams),
                                                                        plan.streams)]  # fmt: skip
            self.streams = [*self.streams, *added]
            started = self._started
        if started:
            for s in added:
                s.thread.start()
        if added:
            log.info("link to %s: %d streams, %d x %d KiB in flight each (%s)", self.key,
                     plan.streams, plan.window_chunks, plan.chunk_bytes >> 10,
                     self.estimator.estimate())  # fmt: skip
        if plan.limited_by and plan.limited_by != old.limited_by:
            log.warning("link to %s: pdd keeps less than a chunk loop's bytes (%gx the path's "
                        "bandwidth-delay product) in flight (%s): limited by %s", self.key,
                        CHUNK_LOOP_RTTS, self.estimator.estimate(), plan.limited_by)  # fmt: skip
        return plan

    def submit(self, rec: OutRecord) -> None:
        with self._lock:
            broken = self.broken
            if broken is None:
                self._work.append((rec, 0))
        if broken is not None:
            self.transport.outbound.stop(rec.transfer_id, TransferState.FAILED, broken)
            return
        # Wake only as many streams as there are chunks: a one-block transfer wakes one.
        for s in self.streams[: len(rec.chunks)]:
            s.wake()

    def cancel(self, transfer_id: int, reason: int) -> None:
        with self._lock:
            self._control.append(pack_cancel(transfer_id, reason))
        self._wake_all()

    def take(self) -> bytes | tuple[OutRecord, int] | int | None:
        """Next thing to send: a control frame first, else the next chunk of the open transfer
        with the fewest bytes left (deferred transfers only when no other has a chunk
        waiting), else a warm-up's next PROBE (its size)."""
        with self._lock:
            if self._control:
                return self._control.popleft()
            for queue in (self._work, self._deferred):
                at, least, kept = -1, math.inf, 0
                for _ in range(len(queue)):  # drop stopped transfers, set deferred ones aside
                    rec, index = queue.popleft()
                    if rec.stop_state is not None:  # a hint; begin_chunk decides under its lock
                        continue
                    if rec.background and queue is self._work:
                        self._deferred.append((rec, index))
                        continue
                    queue.append((rec, index))  # kept in order: it is queue[kept]
                    left = _bytes_left(rec, index)
                    if left < least:
                        at, least = kept, left
                    kept += 1
                if at >= 0:
                    rec, index = queue[at]
                    if index + 1 < len(rec.chunks):
                        queue[at] = (rec, index + 1)
                    else:
                        del queue[at]
                    return rec, index
            probe = self._probe
            if probe is not None and probe.left > 0:
                n = min(probe.left, self.plan.chunk_bytes, MAX_PROBE_BYTES)
                probe.left -= n
                probe.sent += n
                probe.unacked += 1
                return n
        return None

    def fail(self, reason: str) -> None:
        """Break the link: fail its open transfers and stop its streams (first reason wins)."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = reason
            self._work.clear()
            self._deferred.clear()
        self.transport.outbound.stop_where(
            lambda r: r.peer == self.key, TransferState.FAILED, reason
        )
        for s in self.streams:
            shutdown_quietly(s.sock)
        self._wake_all()

    def close(self) -> None:
        self.fail("transport closed")
        for s in self.streams:
            if s.thread.is_alive():
                s.thread.join()
            s.close_pipe()

    def threads(self) -> list[threading.Thread]:
        return [s.thread for s in self.streams]

    def _wake_all(self) -> None:
        for s in self.streams:
            s.wake()


def _bytes_left(rec: OutRecord, index: int) -> float:
    """A transfer's bytes from chunk ``index`` on (its chunks are of one size but the last)."""
    return rec.bytes_total * (len(rec.chunks) - index) / max(len(rec.chunks), 1)


class SenderStream:
    def __init__(self, link: PeerLink, index: int, count: int):
        self.link = link
        self.index, self.count = index, count
        self.config = link.transport.config
        self.sock: socket.socket | None = None
        self.unacked: deque[int] = deque()  # payload bytes of each chunk awaiting its ACK
        self.unacked_bytes = 0  # their sum
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._last_rtt = 0.0
        self._last_send = time.monotonic()
        self._keep_warm_head = False  # the oldest unacked frame is an empty keep-warm PROBE
        name = f"tcp-send-{link.key}-{index}"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full (a wake is already pending) or closed (stream gone)

    def close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass  # already closed

    def _run(self) -> None:
        try:
            self._connect()
            self._loop()
        except (OSError, TransferError, ValueError) as exc:
            self.link.fail(f"connection to {self.link.key} lost: {exc}")
        except Exception as exc:  # a bug: still fail the link so nothing waits forever
            log.exception("sender stream to %s crashed", self.link.key)
            self.link.fail(f"sender stream crashed: {type(exc).__name__}: {exc}")
        finally:
            close_quietly(self.sock)

    def _connect(self) -> None:
        cfg, peer = self.config, self.link.peer
        raw = socket.create_connection((peer.host, peer.port), timeout=cfg.connect_timeout_s)
        tune(raw, cfg, cfg.min_chunk_bytes)
        ctx = self.link.transport.client_tls
        self.sock = ctx.wrap_socket(raw) if ctx is not None else raw
        if self.link.broken is not None:  # closed while we were connecting
            raise TransferError(self.link.broken)
        self.reader = FrameReader(self.sock)
        kind, nonce = self.reader.read_frame()  # the receiver's challenge (connect timeout)
        if kind is not FrameKind.CHALLENGE:
            raise TransferError(f"expected CHALLENGE, got {kind.name}")
        self.sock.settimeout(None)
        sender = self.link.transport.sender_id
        proof = hello_proof(self.link.transport.token, sender, nonce).tobytes()
        send_all(self.sock, [pack_hello(sender, self.index, self.count), pack_auth(proof)])
        rtt = kernel_rtt_s(self.sock)
        self.link.estimator.on_rtt(rtt)
        if 0 < rtt < LAN_RTT_S:  # a LAN: a small unsent queue would only cost wakeups
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, cfg.chunk_bytes)

    def _loop(self) -> None:
        while self.link.broken is None:
            self._drain_acks()
            window = self.link.replan(time.monotonic()).stream_window_bytes
            item = self.link.take() if self.unacked_bytes < window else None
            if isinstance(item, bytes):
                send_all(self.sock, [item])
            elif isinstance(item, int):
                self._send_probe(item)
            elif item is not None:
                self._send_chunk(*item)
            elif self._keep_warm_due():
                self._keep_warm_head = True
                send_all(self.sock, [pack_probe(0)])
                self.unacked.append(0)
                self._last_send = time.monotonic()
            else:
                self._sleep()

    def _keep_warm_due(self) -> bool:
        """An idle WAN stream's keep-warm PROBE is due (module doc)."""
        every = self.config.keep_warm_s
        if every <= 0 or self.unacked or time.monotonic() - self._last_send < every:
            return False
        if not self.link.peer.probes:  # an older receiver: a PROBE would break the link
            return False
        est = self.link.estimator.estimate()
        return est is not None and est.rtt_s >= LAN_RTT_S

    def _sleep(self) -> None:
        if self.reader.has_data():
            return
        every = self.config.keep_warm_s
        select.select([self.sock, self._wake_r], [], [], min(1.0, every) if every > 0 else 1.0)
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass  # drained

    def _drain_acks(self) -> None:
        transport = self.link.transport
        while self.reader.has_data():
            kind, body = self.reader.read_frame()
            if kind is not FrameKind.ACK or not self.unacked:
                raise TransferError(f"unexpected {kind.name} frame from receiver")
            tid, _index, status, nbytes = unpack_ack(body)
            wire = self.unacked.popleft()  # the link carried the wire bytes, nbytes is raw
            if self._keep_warm_head:  # its ack: nothing to count
                self._keep_warm_head = False
                continue
            self.unacked_bytes -= wire
            now = time.monotonic()
            self.link.estimator.on_ack(wire, now)
            if tid == PROBE_ID:
                self.link.probe_acked(wire, now)
            else:
                transport.outbound.ack(tid, status, nbytes)
            if now - self._last_rtt > RTT_REFRESH_S:
                self._last_rtt = now
                self.link.estimator.on_rtt(kernel_rtt_s(self.sock))

    def _send_probe(self, nbytes: int) -> None:
        self.link.estimator.on_send(nbytes, time.monotonic())
        send_all(self.sock, [pack_probe(nbytes)])
        for off in range(0, nbytes, len(_ZEROS)):
            send_all(self.sock, [_ZEROS[: min(len(_ZEROS), nbytes - off)]])
        self.unacked.append(nbytes)
        self.unacked_bytes += nbytes
        self._last_send = time.monotonic()

    def _send_chunk(self, rec: OutRecord, index: int) -> None:
        transport = self.link.transport
        if transport.outbound.begin_chunk(rec.transfer_id) is None:
            return
        try:
            left_ms = max(0, int((rec.deadline - time.monotonic()) * 1000))
            header, clean, payload = transport._wire_payload(rec, index)
            wire = header.wire_size
            self.link.estimator.on_send(wire, time.monotonic())
            hasher = Hasher(header.checksum_algo)
            # The checksum is of the bytes meant for the wire (`clean`), computed per slice
            # just before that slice is sent, while it is in cache; it travels as a trailer.
            parts = [header.pack_sent(0, left_ms)]
            for off in range(0, wire, SLICE):
                end = min(wire, off + SLICE)
                hasher.update(clean[off:end])
                parts.append(payload[off:end])
                send_all(self.sock, parts)
                parts = []
            send_all(self.sock, [*parts, TRAILER.pack(hasher.digest())])
            self.unacked.append(wire)
            self.unacked_bytes += wire
            self._last_send = time.monotonic()
        finally:
            transport.outbound.end_chunk(rec.transfer_id)
