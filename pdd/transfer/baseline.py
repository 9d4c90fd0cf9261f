"""Raw baselines the transports are measured against, in the same run (`pdd bench transfer`).

- raw TCP: one connection, blocking `sendall` of the payload, `recv_into` one preallocated
  buffer, one byte back when the last byte landed. No chunking, checksum or framing.
- raw UCX: ucxx tag send/recv between worker addresses (shared memory on one host), the
  same progress mode as `UcxTransport`, an 8-byte reply when the receive completed.

Each baseline's receiver is a child process (`python -m pdd.transfer.baseline tcp|ucx`)
that prints its address as one JSON line and serves until stdin closes.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

_LEN = struct.Struct("<Q")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < view.nbytes:
        got = sock.recv_into(view[pos:])
        if got == 0:
            raise ConnectionResetError("closed")
        pos += got


def _tcp_child(host: str, max_bytes: int) -> None:
    srv = socket.create_server((host, 0))
    print(json.dumps({"host": host, "port": srv.getsockname()[1]}), flush=True)
    buf = memoryview(np.empty(max_bytes, np.uint8))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(8)
    try:
        while True:
            _recv_exact(conn, memoryview(head))
            n = _LEN.unpack(head)[0]
            _recv_exact(conn, buf[:n])
            conn.sendall(b"k")
    except (ConnectionResetError, OSError):
        return


class RawTcp:
    """Parent side of the raw TCP baseline."""

    def __init__(self, max_bytes: int, host: str = "127.0.0.1", netns: str = ""):
        self.proc = _spawn(["tcp", host, str(max_bytes)], netns)
        addr = json.loads(self.proc.stdout.readline())
        self.sock = socket.create_connection((addr["host"], addr["port"]), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)

    def send(self, payload: np.ndarray) -> float:
        """Seconds from the first byte sent to the receiver's confirmation."""
        t0 = time.perf_counter()
        self.sock.sendall(_LEN.pack(payload.nbytes))
        self.sock.sendall(memoryview(payload))
        if self.sock.recv(1) != b"k":
            raise ConnectionResetError("raw tcp receiver died")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        _stop(self.proc)


def _ucx_worker(timeout_ms: int = 1):
    import ucxx._lib.libucxx as ucx

    ctx = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
    worker = ucx.UCXWorker(ctx)
    worker.start_progress_thread(polling_mode=False, epoll_timeout=timeout_ms)
    return ucx, ctx, worker


def _wait(requests, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(r.completed for r in requests):
        if time.monotonic() > deadline:
            raise TimeoutError("ucx request did not complete")
        time.sleep(0.0001)
    for r in requests:
        r.check_error()


def _ucx_child(max_bytes: int) -> None:
    from ucxx._lib.arr import Array

    ucx, ctx, worker = _ucx_worker()
    print(json.dumps({"address": worker.address.tobytes().hex()}), flush=True)
    parent = bytes.fromhex(json.loads(sys.stdin.readline())["address"])
    ep = worker.create_endpoint_from_worker_address(
        ucx.UCXAddress.create_from_buffer(parent), False
    )
    buf = np.empty(max_bytes, np.uint8)
    head = np.zeros(1, np.uint64)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        r = worker.tag_recv(Array(head), ucx.UCXXTag(1))
        while not r.completed and not stop.is_set():
            time.sleep(0.0001)
        if stop.is_set():
            break
        r2 = worker.tag_recv(Array(buf[: int(head[0])]), ucx.UCXXTag(2))
        _wait([r2])
        _wait([ep.tag_send(Array(np.ones(1, np.uint64)), ucx.UCXXTag(3))])
    worker.stop_progress_thread()


class RawUcx:
    """Parent side of the raw ucxx baseline (worker-address endpoints, one host)."""

    def __init__(self, max_bytes: int):
        from ucxx._lib.arr import Array

        self._array = Array
        self.proc = _spawn(["ucx", "0", str(max_bytes)], "")
        child = bytes.fromhex(json.loads(self.proc.stdout.readline())["address"])
        self.ucx, self.ctx, self.worker = _ucx_worker()
        self.proc.stdin.write(json.dumps({"address": self.worker.address.tobytes().hex()}) + "\n")
        self.proc.stdin.flush()
        addr = self.ucx.UCXAddress.create_from_buffer(child)
        self.ep = self.worker.create_endpoint_from_worker_address(addr, False)

    def send(self, payload: np.ndarray) -> float:
        ucx, arr = self.ucx, self._array
        t0 = time.perf_counter()
        ack = np.zeros(1, np.uint64)
        reply = self.worker.tag_recv(arr(ack), ucx.UCXXTag(3))
        sends = [
            self.ep.tag_send(arr(np.array([payload.nbytes], np.uint64)), ucx.UCXXTag(1)),
            self.ep.tag_send(arr(payload), ucx.UCXXTag(2)),
        ]
        _wait(sends + [reply])
        return time.perf_counter() - t0

    def close(self) -> None:
        _stop(self.proc)
        self.worker.stop_progress_thread()


def _spawn(args: list[str], netns: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdd.transfer.baseline", *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass  # child already gone
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    proc.stdout.close()


if __name__ == "__main__":
    if sys.argv[1] == "tcp":
        _tcp_child(sys.argv[2], int(sys.argv[3]))
    else:
        _ucx_child(int(sys.argv[3]))
