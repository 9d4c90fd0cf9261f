"""Test helpers shared by the integration suites: start `pdd serve`, wait, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdd.launch import free_port
from pdd.launch.topology import STOP_GRACE_S

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Served:
    """A running `pdd serve` and the ports it was given."""

    proc: subprocess.Popen
    url: str
    router_port: int
    worker_ports: dict[str, int]
    output: deque = field(default_factory=lambda: deque(maxlen=400))
    metrics_ports: dict[str, int] = field(default_factory=dict)  # with pin_metrics_ports

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(list(self.output)[-n:])


def serve(
    config: str,
    worker_ids: list[str],
    overrides: list[str] = (),
    timeout_s: float = 300,
    pin_metrics_ports: bool = False,
):
    """Start `pdd serve` on free ports and wait for its ready line (with a deadline).
    ``pin_metrics_ports``: also give each worker a known metrics port (``metrics_ports``)."""
    router_port = free_port()
    worker_ports = {w: free_port() for w in worker_ids}
    metrics_ports = {w: free_port() for w in worker_ids} if pin_metrics_ports else {}
    args = [sys.executable, "-m", "pdd.cli", "serve", "--config", config]
    args += ["--set", f"router.port={router_port}"]
    for i, w in enumerate(worker_ids):
        args += ["--set", f"workers.{i}.port={worker_ports[w]}"]
        if w in metrics_ports:
            args += ["--set", f"workers.{i}.metrics_port={metrics_ports[w]}"]
    for o in overrides:
        args += ["--set", o]
    served = Served(_popen(args), "", router_port, worker_ports, metrics_ports=metrics_ports)
    return _await_ready(served, "pdd ready: ", timeout_s)


def _popen(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _await_ready(served: Served, marker: str, timeout_s: float) -> Served:
    """Pump the process's output into served.output; wait for `marker URL` (deadline)."""
    ready = threading.Event()

    def pump():
        for line in served.proc.stdout:
            served.output.append(line.rstrip("\n"))
            if marker in line and not ready.is_set():
                served.url = line.split(marker, 1)[1].split()[0]
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if served.proc.poll() is not None or time.monotonic() > deadline:
            stop(served)
            said = [x for x in served.output if "pdd serve:" in x or "pdd.launch" in x]
            raise RuntimeError(  # what the launcher said last: CI shows only a log's tail
                f"{marker.strip()} never came; last output:\n{served.log_tail()}"
                + f"\n{marker.strip()} never came; the launcher said:\n"
                + "\n".join(said[-20:])
            )
    return served


# `pdd serve` stops the router, then the workers, each stage SIGKILLed after STOP_GRACE_S at
# worst, then takes its lab down: past this bound the launcher itself is stuck.
STOP_TIMEOUT_S = 2 * STOP_GRACE_S + 30


def stop(served: Served, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM `pdd serve` and wait; it stops every child it started."""
    if served.proc.poll() is None:
        began = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        try:
            served.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            served.proc.kill()
            served.proc.wait()
            raise AssertionError(
                f"pdd serve still running {timeout_s:.0f} s after SIGTERM; its output:\n"
                + served.log_tail()
            ) from None
        served.output.append(
            f"[test] pdd serve exited {time.monotonic() - began:.1f} s after SIGTERM"
        )
    return served.proc.returncode


def children_of(pid: int) -> list[int]:
    """Every live descendant of pid (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents[int(entry)] = ppid
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def run_oracle(
    prompts: list, dtype: str, max_tokens: int, timeout_s: float = 900, engine: dict | None = None
) -> list[dict]:
    """Greedy tokens of a direct vLLM run (tests/e2e/vllm_oracle.py: no pdd code involved);
    ``engine``: more of vLLM's engine arguments (the oracle's ENGINE_JSON)."""
    import json

    from pdd.config import ModelConfig

    model_dir = str(ModelConfig(dtype=dtype).resolved_path())
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "e2e", "vllm_oracle.py"), model_dir, dtype,
         str(max_tokens), json.dumps(engine or {})],
        input=json.dumps(prompts), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"oracle failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("ORACLE_JSON:")][-1]
    return json.loads(line[len("ORACLE_JSON:") :])


def start_router(config: str, overrides: list[str], timeout_s: float = 120):
    """One extra `pdd router` process (e.g. another mode over the same workers)."""
    port = free_port()
    args = [sys.executable, "-m", "pdd.router.main", "--config", config]
    for o in [*overrides, f"router.port={port}"]:
        args += ["--set", o]
    return _await_ready(Served(_popen(args), "", port, {}), "pdd router ready: ", timeout_s)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll predicate() until true; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval_s)


def at_once(fn, items, clients: int = 4) -> list:
    """``fn`` over ``items`` from ``clients`` threads, the results in ``items``' order: a few
    clients at once, as a server meets them (the engines batch their requests). The first
    exception is raised here."""
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(fn, items))
