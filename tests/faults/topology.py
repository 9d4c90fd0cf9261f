"""A local PDD topology whose processes the fault tests start, kill and restart one by one.

`pdd serve` supervises its children and stops the whole topology as soon as one dies, which
is right for operators and wrong for a test that kills a worker on purpose; so this starts
the same commands the launcher runs (`python -m pdd.launch.worker --worker ID`, then the
router) from one config, on free ports, and keeps each process's output.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field

import grpc
import httpx

from pdd.cache.arena import unlink_stale
from pdd.config import load_config
from pdd.launch import free_port
from pdd.proto import worker_pb2, worker_pb2_grpc
from pdd.worker.kv_plane import ARENA_PREFIX, FENCE_PREFIX
from tests.helpers import Served, _await_ready, _popen, children_of, start_router, stop, wait_until

ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


@dataclass
class Topology:
    config: str
    ports: dict[str, int] = field(default_factory=dict)
    workers: dict[str, Served] = field(default_factory=dict)
    router: Served | None = None

    def __post_init__(self) -> None:
        os.environ.update(ENV)
        ids = [w.id for w in load_config(self.config).workers]
        self.ports = {w: free_port() for w in ids}
        self.overrides = [f"workers.{i}.port={self.ports[w]}" for i, w in enumerate(ids)]

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def start(self, timeout_s: float = 400) -> None:
        procs = {w: self._spawn(w) for w in self.ports}  # every engine starts at once
        self.workers.update(procs)  # stop() reaches each one, even if another never gets ready
        for served in procs.values():
            _await_ready(served, "pdd worker ready: ", timeout_s)
        self.router = start_router(self.config, self.overrides)
        wait_until(lambda: self.healthy() == set(self.ports), 60, "every worker healthy")

    def _spawn(self, worker_id: str) -> Served:
        args = [sys.executable, "-m", "pdd.launch.worker", "--config", self.config]
        args += ["--worker", worker_id]
        for o in self.overrides:
            args += ["--set", o]
        return Served(_popen(args), "", self.ports[worker_id], {})

    def restart(self, worker_id: str, timeout_s: float = 300) -> None:
        self.workers[worker_id] = _await_ready(
            self._spawn(worker_id), "pdd worker ready: ", timeout_s
        )
        wait_until(lambda: worker_id in self.healthy(), 60, f"{worker_id} healthy again")

    def healthy(self) -> set[str]:
        body = httpx.get(self.url.removesuffix("/v1") + "/health", timeout=5).json()
        return {w["id"] for w in body.get("workers", []) if w.get("healthy")}

    def kill_tree(self, worker_id: str) -> list[int]:
        """SIGKILL a worker and its engine core at once (a machine dying); returns the pids."""
        proc = self.workers[worker_id].proc
        pids = [proc.pid, *children_of(proc.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        return pids

    def engine_pids(self, worker_id: str) -> list[int]:
        return children_of(self.workers[worker_id].proc.pid)

    def alive(self, worker_id: str) -> bool:
        return self.workers[worker_id].proc.poll() is None

    def stats(self, worker_id: str) -> worker_pb2.StatsResponse:
        with grpc.insecure_channel(f"127.0.0.1:{self.ports[worker_id]}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            return stub.Stats(worker_pb2.StatsRequest(), timeout=10)

    def assert_no_leaks(self, timeout_s: float = 30) -> None:
        """Every live worker: nothing pinned, no open transfer, nothing running."""
        for w in self.workers:
            if not self.alive(w):
                continue
            wait_until(
                lambda w=w: (
                    (s := self.stats(w)).pinned_slots == 0
                    and s.open_transfers == 0
                    and s.running_requests == 0
                ),
                timeout_s,
                f"{w}: zero pinned slots, open transfers and running requests",
            )

    def stop(self) -> None:
        if self.router is not None:
            stop(self.router)
        for served in self.workers.values():
            if served.proc.poll() is None:
                served.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for served in self.workers.values():
            try:
                served.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 (a stuck worker must still go)
                served.proc.kill()
                served.proc.wait()
        # The shared-memory KV arenas of the workers the tests killed (a SIGKILLed worker
        # cannot unlink them; the next worker start would): only dead owners' are removed.
        for prefix in (ARENA_PREFIX, FENCE_PREFIX):
            unlink_stale(prefix)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
