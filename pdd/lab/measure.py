"""Measure a lab's WAN link from the inside: RTT by UDP echo, loss by counted datagrams,
throughput by one bulk TCP flow.

Each runs in the calling process: the far end is a thread whose socket was opened inside the
destination namespace, the near end a socket opened inside the source namespace (a socket
stays in the namespace it was made in). Everything started here is stopped before returning.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time
from typing import NamedTuple

from pdd.errors import LabError
from pdd.lab.netns import enter

_SO_RCVBUFFORCE = 33  # Linux; root may exceed net.core.rmem_max
_BURST, _BURST_GAP_S = 10, 0.001  # datagrams_lost's pacing: 10 a millisecond


class LinkMeasurement(NamedTuple):
    rtt_ms: float  # median round trip of small UDP probes
    throughput_mbit: float  # goodput of one bulk TCP flow once past slow start


def _socket_in(netns: str | None, kind: int) -> socket.socket:
    """A socket in ``netns`` (None: this process's own namespace, e.g. the host's)."""
    if netns is None:
        return socket.socket(socket.AF_INET, kind)
    with enter(netns):
        return socket.socket(socket.AF_INET, kind)


def _udp_echo(sock: socket.socket, stop: threading.Event) -> None:
    """Echo datagrams until ``stop`` is set (checked every 0.1 s)."""
    sock.settimeout(0.1)
    while not stop.is_set():
        try:
            data, peer = sock.recvfrom(2048)
        except TimeoutError:
            continue
        sock.sendto(data, peer)


def measure_rtt(
    src_ns: str, dst_ns: str, dst_ip: str, probes: int = 21, timeout_s: float = 2.0
) -> float:
    """Median RTT in ms of ``probes`` UDP probes from src_ns to an echo at dst_ip in dst_ns."""
    return statistics.median(rtt_probes(src_ns, dst_ns, dst_ip, probes, timeout_s))


def rtt_probes(
    src_ns: str | None, dst_ns: str, dst_ip: str, probes: int, timeout_s: float = 2.0
) -> list[float]:
    """The RTTs in ms of the probes that came back, in the order sent (src_ns None: the host).

    A probe whose echo is not back within ``timeout_s`` counts as lost and is not retried;
    raises LabError if none came back.
    """
    server = _socket_in(dst_ns, socket.SOCK_DGRAM)
    client = _socket_in(src_ns, socket.SOCK_DGRAM)
    with server, client:
        server.bind((dst_ip, 0))
        stop = threading.Event()
        echo = threading.Thread(target=_udp_echo, args=(server, stop), name="lab-rtt-echo")
        echo.start()
        try:
            client.connect(server.getsockname())
            client.settimeout(timeout_s)
            rtts = [rtt for seq in range(probes) if (rtt := _probe(client, seq)) is not None]
        finally:
            stop.set()
            echo.join()
    if not rtts:
        raise LabError(f"no RTT probe came back from {dst_ip} in {dst_ns}")
    return rtts


def datagrams_lost(
    src_ns: str, dst_ns: str, dst_ip: str, datagrams: int, quiet_s: float = 0.5
) -> float:
    """The fraction of ``datagrams`` small UDP datagrams from src_ns to dst_ip that never
    arrive (the link's loss); the rest is read until ``quiet_s`` of silence.

    They leave paced, 10 a millisecond: a burst also arrives as a burst, and a receiving host
    whose cores are busy (softirqs deferred) drops past its 1,000-packet backlog, which is the
    host, not the link.
    """
    rx = _socket_in(dst_ns, socket.SOCK_DGRAM)
    tx = _socket_in(src_ns, socket.SOCK_DGRAM)
    with rx, tx:
        rx.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 8 << 20)
        rx.bind((dst_ip, 0))
        for seq in range(datagrams):
            tx.sendto(struct.pack("!I", seq) + bytes(28), rx.getsockname())
            if seq % _BURST == _BURST - 1:
                time.sleep(_BURST_GAP_S)
        rx.settimeout(quiet_s)
        got: set[int] = set()
        while len(got) < datagrams:
            try:
                got.add(struct.unpack("!I", rx.recv(64)[:4])[0])
            except TimeoutError:
                break
    if not got <= set(range(datagrams)):
        raise LabError(f"datagrams that were never sent arrived at {dst_ip} in {dst_ns}")
    return 1 - len(got) / datagrams


def _probe(client: socket.socket, seq: int) -> float | None:
    start = time.perf_counter()
    client.send(struct.pack("!I", seq) + bytes(60))
    try:
        while True:
            data = client.recv(2048)
            if struct.unpack("!I", data[:4])[0] == seq:
                return (time.perf_counter() - start) * 1000
    except TimeoutError:
        return None


class _Sink:
    """Receives one TCP flow and records (time, bytes so far) after every read."""

    def __init__(self, listener: socket.socket):
        self.listener = listener
        self.samples: list[tuple[float, int]] = []
        self.received = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                conn.settimeout(self.listener.gettimeout())
                buf = bytearray(64 * 1024)
                while n := conn.recv_into(buf):
                    self.received += n
                    self.samples.append((time.perf_counter(), self.received))
        except OSError as exc:
            self.error = exc

    def settled_mbit(self) -> float:
        """Rate over the last three quarters of the flow's duration (slow start excluded)."""
        t_first, t_end = self.samples[0][0], self.samples[-1][0]
        cut = t_first + (t_end - t_first) / 4
        i = max(1, next(i for i, (t, _) in enumerate(self.samples) if t >= cut))
        t_base, base = self.samples[i - 1]
        if t_end <= t_base:
            raise LabError("throughput flow too short to time")
        return (self.received - base) * 8 / (t_end - t_base) / 1e6


def measure_throughput(
    src_ns: str, dst_ns: str, dst_ip: str, nbytes: int, max_s: float = 10.0
) -> float:
    """Goodput in Mbit/s of one TCP flow from src_ns to dst_ip in dst_ns.

    The flow carries ``nbytes`` or stops after ``max_s`` seconds (a lossy link may crawl).
    It is timed at the receiver over the last three quarters of its duration, so TCP slow
    start (a few RTTs) does not count: the figure is the rate a long transfer settles at.
    """
    listener = _socket_in(dst_ns, socket.SOCK_STREAM)
    client = _socket_in(src_ns, socket.SOCK_STREAM)
    timeout_s = max_s + 10
    with listener, client:
        listener.settimeout(timeout_s)
        listener.bind((dst_ip, 0))
        listener.listen(1)
        sink = _Sink(listener)
        thread = threading.Thread(target=sink.run, name="lab-throughput-sink")
        thread.start()
        try:
            client.settimeout(timeout_s)
            client.connect(listener.getsockname())
            _send(client, nbytes, time.monotonic() + max_s)
            client.shutdown(socket.SHUT_WR)
        finally:
            thread.join(timeout=timeout_s)
    if sink.error is not None or thread.is_alive() or len(sink.samples) < 2:
        raise LabError(f"throughput flow failed after {sink.received} B: {sink.error}")
    return sink.settled_mbit()


def _send(sock: socket.socket, nbytes: int, deadline: float) -> None:
    chunk = memoryview(bytes(64 * 1024))
    sent = 0
    while sent < nbytes and time.monotonic() < deadline:
        n = min(len(chunk), nbytes - sent)
        sock.sendall(chunk[:n])
        sent += n
