"""A transport peer in a second process, for the contract suite and `pdd bench transfer`.

The child runs one transport (receiver or sender) and speaks JSON lines: it prints
`{"event": "ready", "address": {...}}` once listening, then answers commands read from stdin.

    receiver: {"cmd": "results"} -> landed transfers with a CRC of their bytes
              {"cmd": "stats"}   -> TransportStats
              {"cmd": "open_gate"} lets chunks past the gate (see --gate-chunk)
    sender:   {"cmd": "send", "peer": {...}, "nbytes": N, "seed": S} -> {"transfer_id": ...}
    both:     {"cmd": "quit"} -> closes the transport, prints final stats, exits

Payload bytes are a pure function of (seed, nbytes) (`pattern`), so each side can check the
other's bytes without shipping them. Tests kill the child with SIGKILL to emulate peer death.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from pdd.config.transfer import TransferConfig
from pdd.errors import TransferError
from pdd.transfer import KVSegment, PeerAddress, ReceiverHooks, SendRequest, create_transport
from pdd.transfer.wire import ChunkHeader, checksum, default_checksum_algo


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic payload bytes for (seed, nbytes)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def crc_of(data: Any) -> int:
    return checksum(default_checksum_algo(), data)


def peer_to_json(peer: PeerAddress) -> dict:
    d = asdict(peer)
    d["ucx_address"] = peer.ucx_address.hex()
    return d


def peer_from_json(d: dict) -> PeerAddress:
    return PeerAddress(**{**d, "ucx_address": bytes.fromhex(d["ucx_address"])})


class LandingZone:
    """Receiver-side allocator for tests: one buffer per (transfer, segment), optional gate.

    With `reuse_bytes`, every chunk lands in one preallocated buffer (benchmarks: no page
    faults in the measurement) and nothing is kept.
    """

    def __init__(self, gate_chunk: int = -1, reuse_bytes: int = 0, slow_s: float = 0.0):
        self._lock = threading.Lock()
        self.buffers: dict[int, dict[int, np.ndarray]] = {}
        self.gate = threading.Event()
        self.gate_chunk = gate_chunk
        self.gate_reached = threading.Event()
        self.slow_s = slow_s
        self.reuse = np.empty(reuse_bytes, np.uint8) if reuse_bytes else None
        self.headers: list[ChunkHeader] = []  # every chunk header, in arrival order
        self.last_seen: dict[int, tuple[int, float]] = {}  # tid -> (chunks, monotonic time)

    def __call__(self, h: ChunkHeader) -> memoryview:
        """Allocator: the buffer for one chunk (blocks at the gate chunk until opened)."""
        if h.chunk_index == self.gate_chunk:
            self.gate_reached.set()
            if not self.gate.wait(30):
                raise TransferError("test gate never opened")
        if self.slow_s:
            time.sleep(self.slow_s)
        with self._lock:
            count = self.last_seen.get(h.transfer_id, (0, 0.0))[0]
            self.last_seen[h.transfer_id] = (count + 1, time.monotonic())
            if self.reuse is None:  # benchmarks keep nothing per chunk
                self.headers.append(h)
            if self.reuse is not None:
                start = h.offset % max(1, self.reuse.nbytes - h.nbytes + 1)
                return memoryview(self.reuse)[start : start + h.nbytes]
            segs = self.buffers.setdefault(h.transfer_id, {})
            buf = segs.get(h.segment_index)
            if buf is None:
                buf = segs[h.segment_index] = np.zeros(h.segment_nbytes, np.uint8)
        return memoryview(buf)[h.offset : h.offset + h.nbytes]

    def seen(self, transfer_id: int) -> list[ChunkHeader]:
        with self._lock:
            return [h for h in self.headers if h.transfer_id == transfer_id]

    def take(self, transfer_id: int) -> list[np.ndarray]:
        with self._lock:
            segs = self.buffers.pop(transfer_id, {})
        return [segs[i] for i in sorted(segs)]


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdd.transfer.testing")
    ap.add_argument("role", choices=["receiver", "sender"])
    ap.add_argument("--kind", default="tcp")
    ap.add_argument("--config", default="{}", help="TransferConfig fields as JSON")
    ap.add_argument("--gate-chunk", type=int, default=-1)
    ap.add_argument("--reuse-bytes", type=int, default=0)
    ap.add_argument("--slow-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    config = TransferConfig(**json.loads(args.config))
    zone = LandingZone(args.gate_chunk, args.reuse_bytes, args.slow_ms / 1000)
    # tid -> monotonic time of its report; CLOCK_MONOTONIC is system-wide, so the parent on
    # the same host (any network namespace) can compare it with its own clock
    reported: dict[int, float] = {}

    def on_received(result) -> None:
        reported[result.transfer_id] = time.monotonic()

    hooks = ReceiverHooks(zone, on_received) if args.role == "receiver" else None
    transport = create_transport(args.kind, config, hooks=hooks)
    transport.start()
    _reply({"event": "ready", "address": peer_to_json(transport.address), "pid": os.getpid()})
    keep: dict[int, np.ndarray] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        _reply(_serve(cmd, transport, zone, reported, keep))
    zone.gate.set()
    transport.close()
    _reply({"event": "closed", "stats": asdict(transport.stats())})
    return 0


def _serve(cmd: dict, transport, zone: LandingZone, reported: dict, keep: dict) -> dict:
    """Answer one command of the parent (see the module docstring)."""
    op = cmd["cmd"]
    if op == "stats":
        return asdict(transport.stats())
    if op == "open_gate":
        zone.gate.set()
        return {"ok": True}
    if op == "results":
        out = []
        for r in transport.poll_received():
            segs = zone.take(r.transfer_id)
            crc = crc_of(np.concatenate(segs)) if segs else crc_of(b"")
            _chunks, last = zone.last_seen.pop(r.transfer_id, (0, 0.0))
            times = {"last_chunk_t": last, "reported_t": reported.pop(r.transfer_id, 0.0)}
            out.append({**asdict(r), "state": r.state.value, "crc": crc, **times})
        return {"results": out}
    if op == "send":
        data = keep.setdefault(cmd["seed"], pattern(cmd["seed"], cmd["nbytes"]))
        req = SendRequest(cmd.get("request_id", "req"), [KVSegment(data, 0, 1)])
        return {"transfer_id": transport.send(peer_from_json(cmd["peer"]), req).transfer_id}
    return {"error": f"unknown command {op!r}"}


class PeerProcess:
    """Parent-side handle of a child peer; always `stop()` it (tests use a fixture)."""

    def __init__(self, role: str, kind: str, config: dict | None = None, *extra: str, netns=""):
        cmd = [sys.executable, "-m", "pdd.transfer.testing", role, "--kind", kind]
        cmd += ["--config", json.dumps(config or {}), *extra]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        ready = self._read(timeout_s=60)
        self.address = peer_from_json(ready["address"])
        self.pid = ready["pid"]

    def _read(self, timeout_s: float = 30) -> dict:
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(timeout_s)
        if not out or not out[0]:
            self.kill()
            raise TransferError(f"peer process gave no answer within {timeout_s}s")
        return json.loads(out[0])

    def ask(self, cmd: dict, timeout_s: float = 30) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> dict | None:
        """Quit cleanly; returns the child's final stats (None if it was already dead)."""
        if self.proc.poll() is not None:
            return None
        try:
            final = self.ask({"cmd": "quit"})
        except (TransferError, BrokenPipeError, OSError):
            final = None
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()
        return final.get("stats") if final else None


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))


def make_pki(directory: str) -> dict[str, str]:
    """A throwaway CA with a receiver and a sender certificate, plus a rogue CA's certificate
    (tests and benchmarks of the TLS option). Needs the `openssl` command line tool."""
    import shutil

    if shutil.which("openssl") is None:
        raise TransferError("openssl command not found")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "rogue-ca"):
        run(
            "req",
            "-x509",
            *ec,
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
            "-days",
            "2",
            "-subj",
            f"/CN=pdd-{ca}",
        )
    for name, ca in (("receiver", "ca"), ("sender", "ca"), ("rogue", "rogue-ca")):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            f"{ca}.pem",
            "-CAkey",
            f"{ca}.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
        )
    return {n: os.path.join(directory, n) for n in os.listdir(directory)}
