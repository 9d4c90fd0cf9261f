"""Real worker processes (`python -m pdd.launch.worker`) from a temporary topology config, and a
grpc.aio client that drives them the way the router does."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from pdd.launch import free_port
from pdd.proto import worker_pb2 as pb
from pdd.proto import worker_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
READY = "pdd worker ready: "
BLOCK = 32
VOCAB_LO, VOCAB_HI = 200, 40000


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def write_config(tmp: Path, workers: list[dict], **sections) -> Path:
    """A float32 topology sized for three small engines on one machine."""
    cfg = {
        "model": {"dtype": "float32"},
        "engine": {"max_model_len": 2048, "kv_cache_space_gib": 0.5, "block_size": BLOCK,
                   "max_num_seqs": 4},
        "cache": {"host_capacity_gib": 0.25},
        "transfer": {"deadline_s": 30.0},
        "workers": workers,
        **sections,
    }  # fmt: skip
    for w in workers:
        w.setdefault("port", free_port())
        w.setdefault("metrics_port", free_port())
        if w["role"] in ("relay_decode", "main_decode"):
            w.setdefault("kv_port", free_port())
    path = tmp / "topology.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass
class Proc:
    wid: str
    proc: subprocess.Popen
    log: Path
    grpc_addr: str = ""
    metrics_addr: str = ""
    ready: threading.Event = field(default_factory=threading.Event)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""


def start_workers(config: Path, ids: list[str], tmp: Path, timeout_s: float = 300) -> dict:
    """Start every worker at once; wait (with a deadline) for each ready line."""
    procs: dict[str, Proc] = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1", UCX_WARN_UNUSED_ENV_VARS="n")
    for wid in ids:
        log = tmp / f"{wid}.log"
        with log.open("w") as err:
            p = subprocess.Popen(
                [sys.executable, "-m", "pdd.launch.worker", "--config", str(config), "--worker", wid],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip
        procs[wid] = w = Proc(wid, p, log)
        threading.Thread(target=_pump, args=(w,), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        for w in procs.values():
            while not w.ready.wait(0.2):
                if w.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {w.wid} did not start:\n{w.tail()}")
    except BaseException:
        stop_workers(procs)
        raise
    return procs


def _pump(w: Proc) -> None:
    for line in w.proc.stdout:
        if line.startswith(READY):
            fields = dict(kv.split("=", 1) for kv in line[len(READY) :].split())
            w.grpc_addr, w.metrics_addr = fields["grpc"], fields["metrics"]
            w.ready.set()


def stop_workers(procs: dict, timeout_s: float = 60) -> dict[str, int]:
    """SIGTERM every worker, wait; returns the exit codes (SIGKILL if one hangs)."""
    for w in procs.values():
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    codes = {}
    for w in procs.values():
        try:
            codes[w.wid] = w.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            codes[w.wid] = w.proc.wait()
    return codes


def greedy(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=-1)


class Client:
    """Async stubs of every worker on one channel each (use inside one event loop)."""

    def __init__(self, procs: dict) -> None:
        self._channels = {wid: grpc.aio.insecure_channel(w.grpc_addr) for wid, w in procs.items()}
        self.stub = {wid: pb_grpc.WorkerStub(ch) for wid, ch in self._channels.items()}

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    async def generate(self, wid: str, rid: str, prompt: list[int], n: int, **kw):
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=greedy(n), **kw)
        return [r async for r in self.stub[wid].Generate(req, timeout=120)]

    async def stats(self, wid: str) -> pb.StatsResponse:
        return await self.stub[wid].Stats(pb.StatsRequest(), timeout=5)

    async def until_idle(self, wid: str, timeout_s: float = 30) -> pb.StatsResponse:
        """Poll Stats until the worker holds no slot, no transfer and runs nothing."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = await self.stats(wid)
            if (s.pinned_slots, s.open_transfers, s.running_requests, s.waiting_requests) == (
                0, 0, 0, 0,
            ):  # fmt: skip
                return s
            if time.monotonic() > deadline:
                return s
            await asyncio.sleep(0.05)


def tokens(resps) -> list[int]:
    return [t for r in resps for t in r.token_ids]


def kv_in(source: int, kv_id: str, wait_s: float = 30.0) -> pb.KvIn:
    return pb.KvIn(source=source, kv_request_id=kv_id, wait_s=wait_s)
