"""The systems under test: a running endpoint, or a topology this process starts and stops.

``ServedTopology`` lifecycle::

    start(): spawn `pdd serve --config FILE --set router.port=0 [--set ...]`
             -> pump its output into <results>/serve-<mode>.log
             -> wait (deadline) for "pdd ready: URL" in its output -> URL
    stop():  SIGTERM (pdd serve stops its children) -> wait -> SIGKILL after a grace period

The child gets PR_SET_PDEATHSIG, so it goes down with the benchmark however that ends.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Protocol

from pdd.bench.serve.config import CostConfig, ModeConfig
from pdd.bench.serve.nixl import VllmNixl, pair_workers
from pdd.config import load_config
from pdd.errors import ConfigError, PddError
from pdd.launch import die_with_parent

_READY = re.compile(r"pdd ready: (https?://\S+)")
STOP_GRACE_S = 60.0


class System(Protocol):
    api_key: str | None  # the Bearer key clients send (None: no authentication)

    def start(self) -> str:
        """Bring the system up (if this process owns it); return its base URL."""
        ...

    def stop(self) -> None:
        """Tear down what ``start`` brought up; safe to call more than once."""
        ...


class Endpoint:
    """A server someone else runs."""

    def __init__(self, url: str):
        self.url = url
        self.api_key: str | None = None

    def start(self) -> str:
        return self.url

    def stop(self) -> None:
        return None


class ServedTopology:
    """`pdd serve` of one topology config, as a child process this object owns."""

    def __init__(self, mode: ModeConfig, ready_timeout_s: float, log_path: Path):
        assert mode.config is not None
        self.mode = mode
        self.ready_timeout_s = ready_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.url: str | None = None
        self.tail: deque[str] = deque(maxlen=40)
        self._ready = threading.Event()
        self._pump_thread: threading.Thread | None = None
        self.api_key: str | None = None
        self._keys_file = log_path.with_name(f"keys-{mode.name}.txt").absolute()

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "pdd.cli", "serve", "--config", str(self.mode.config)]
        keys = [f"router.api_keys_file={self._keys_file}"] if self.mode.api_key else []
        for item in ["router.port=0", *keys, *self.mode.overrides]:
            args += ["--set", item]
        return args

    def _write_key(self) -> None:
        """mode.api_key: a fresh key in a 0600 keys file the router reads (default tenant)."""
        self.api_key = secrets.token_urlsafe(24)
        fd = os.open(self._keys_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{self.api_key}  # pdd bench serve, mode {self.mode.name}\n")

    def start(self) -> str:
        if self.mode.api_key:
            self._write_key()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            preexec_fn=die_with_parent,
        )
        self._pump_thread = threading.Thread(
            target=self._pump, name=f"serve-{self.mode.name}", daemon=True
        )
        self._pump_thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = "exited" if self.proc.poll() is not None else "was not ready in time"
                self.stop()
                tail = "\n    ".join(list(self.tail)[-20:])
                raise PddError(
                    f"mode {self.mode.name}: `pdd serve` {why} (log {self.log_path}):\n    {tail}"
                )
        assert self.url is not None
        return self.url

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.open("w", encoding="utf-8") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                line = line.rstrip("\n")
                self.tail.append(line)
                url = None if self._ready.is_set() else ready_url(line)
                if url is not None:
                    self.url = url
                    self._ready.set()

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._pump_thread is not None:
            self._pump_thread.join(timeout=10)
        self.proc = None


def ready_url(line: str) -> str | None:
    """The URL of a `pdd ready: URL` line. Searched anywhere in the line: `pdd serve` prints
    its children's output to the same pipe, and a child's line can run into the ready line."""
    match = _READY.search(line)
    return match.group(1) if match else None


def open_system(mode: ModeConfig, ready_timeout_s: float, results: Path) -> System:
    if mode.url is not None:
        return Endpoint(mode.url)
    if mode.server == "vllm_nixl":
        return VllmNixl(mode, ready_timeout_s, results)
    return ServedTopology(mode, ready_timeout_s, results / f"serve-{mode.name}.log")


def mode_workers(mode: ModeConfig, cost: CostConfig) -> dict[str, int]:
    """Workers of each kind in a mode: as configured, else counted from its topology's roles
    (an endpoint without ``workers`` costs nothing and gets no BCR). Raises ConfigError."""
    if mode.workers:
        return dict(mode.workers)
    if mode.config is None:
        return {}
    topo = load_config(mode.config, list(mode.overrides))
    served = set(pair_workers(topo)) if mode.server == "vllm_nixl" else None
    kinds: Counter[str] = Counter()
    for w in topo.workers:
        if served is not None and w.id not in served:
            continue
        if w.role not in cost.role_kind:
            raise ConfigError(f"mode {mode.name}: no cost.role_kind for role {w.role.value}")
        kinds[cost.role_kind[w.role]] += 1
    return dict(kinds)
