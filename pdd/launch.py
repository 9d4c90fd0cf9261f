"""`pdd serve`: start a whole topology (workers + router) as child processes on this host.

Lifecycle::

    resolve ports (0 -> free port) -> write the effective config to a run folder
      -> spawn every worker and the router -> wait for each "ready" line (deadline)
      -> print "pdd ready: http://HOST:PORT/v1" -> supervise
      -> on SIGINT/SIGTERM, or when any child dies: stop every child (TERM, then KILL)

The launcher owns every child: children get PR_SET_PDEATHSIG so they die with it even when it
is killed with SIGKILL. A child that exits before it is ready makes `serve` exit non-zero and
print the child's last output lines.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pdd.config import PddConfig, load_config
from pdd.errors import ConfigError, PddError

log = logging.getLogger("pdd.launch")

READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the child binds it right away)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def resolve_ports(cfg: PddConfig) -> PddConfig:
    """Replace every port 0 by a free port, so the router and workers know each other."""
    data = cfg.model_dump(mode="json")
    if data["router"]["port"] == 0:
        data["router"]["port"] = free_port(cfg.router.host)
    for w in data["workers"]:
        for key in ("port", "metrics_port"):
            if w[key] == 0:
                w[key] = free_port(w["host"])
    return PddConfig.model_validate(data)


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the launcher dies, whatever kills it."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class Child:
    """One supervised child process and the tail of its output."""

    name: str
    argv: list[str]
    ready_prefix: str
    proc: subprocess.Popen | None = None
    ready_line: str | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    ready: threading.Event = field(default_factory=threading.Event)

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
            preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._pump, name=f"pump-{self.name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if not self.ready.is_set() and line.startswith(self.ready_prefix):
                self.ready_line = line
                self.ready.set()
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class Topology:
    """The children of one `pdd serve`: built from config, started, supervised, stopped."""

    def __init__(self, cfg: PddConfig, run_dir: Path):
        self.cfg = cfg
        self.config_path = run_dir / "effective-config.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        py = sys.executable
        conf = ["--config", str(self.config_path)]
        self.children = [
            Child(w.id, [py, "-m", "pdd.worker.main", *conf, "--worker", w.id], "pdd worker ready")
            for w in cfg.workers
        ]
        self.children.append(
            Child("router", [py, "-m", "pdd.router.main", *conf], "pdd router ready")
        )

    @property
    def url(self) -> str:
        return f"http://{self.cfg.router.host}:{self.cfg.router.port}/v1"

    def start(self, timeout_s: float, cancel: threading.Event) -> None:
        """Start the workers, wait until all are ready, then the router (so its first health
        poll already sees them); raise PddError when a child fails or the deadline passes."""
        env = child_env()
        deadline = time.monotonic() + timeout_s
        workers, router = self.children[:-1], self.children[-1]
        for child in workers:
            child.start(env)
        self._wait_ready(workers, deadline, cancel)
        router.start(env)
        self._wait_ready([router], deadline, cancel)

    @staticmethod
    def _wait_ready(children: list[Child], deadline: float, cancel: threading.Event) -> None:
        for child in children:
            while not child.ready.wait(timeout=0.2):
                if cancel.is_set():
                    raise PddError("interrupted before every process was ready")
                if not child.alive():
                    raise PddError(_failure(child, "exited before it was ready"))
                if time.monotonic() > deadline:
                    raise PddError(_failure(child, "not ready before the deadline"))

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def stop(self) -> None:
        # Router first: it stops taking requests, then the workers drain.
        for child in reversed(self.children):
            child.stop()


def _failure(child: Child, what: str) -> str:
    code = child.proc.poll() if child.proc else None
    tail = "\n".join(f"    {line}" for line in list(child.tail)[-20:])
    return f"{child.name} {what} (exit code {code}); last output:\n{tail}"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdd serve", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/colocated.yaml", help="topology YAML")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S)
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    logging.basicConfig(level=os.environ.get("PDD_LOG_LEVEL", "INFO"), stream=sys.stderr)
    try:
        cfg = resolve_ports(load_config(args.config, args.overrides))
    except ConfigError as exc:
        print(f"pdd serve: {exc.message}", file=sys.stderr)
        return 2
    if not cfg.workers:
        print("pdd serve: the config has no workers", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="pdd-serve-") as run_dir:
        topo = Topology(cfg, Path(run_dir))
        try:
            topo.start(args.ready_timeout, stop)
        except PddError as exc:
            print(f"pdd serve: {exc.message}", file=sys.stderr)
            topo.stop()
            return 1
        print(f"pdd ready: {topo.url}", flush=True)
        code = 0
        while not stop.wait(0.5):
            dead = topo.first_dead()
            if dead is not None:
                print(f"pdd serve: {_failure(dead, 'died')}", file=sys.stderr)
                code = 1
                break
        topo.stop()
        return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
