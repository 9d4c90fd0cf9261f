"""The child processes of `pdd serve`: what each runs, and one supervised process.

``child_specs`` is pure (the command line of every worker and of the router, and the
datacenter each runs in; the per-run worker token of ``security.worker_token_file: auto``);
``Child`` owns one running process: it pumps the process's output (prefixed, to stderr),
notices its ready line, and stops it (SIGTERM, which drains it, then SIGKILL once its drain
and exit had their time). `pdd serve` stops the router first (it finishes its open streams),
then the workers (they finish what is left in flight), see ``pdd.launch.topology``.

Every child gets PR_SET_PDEATHSIG, so it dies with the launcher even when the launcher is
killed with SIGKILL. The signal is tied to the thread that forked the child: children are
started from the launcher's main thread only. It survives ``ip netns exec`` (which execs the
command in place, so the pid is the pdd process itself).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pdd.config import PddConfig
from pdd.config.security import AUTO
from pdd.launch.placement import Spawn

WORKER_READY = "pdd worker ready"
EXIT_MARGIN_S = 10.0  # after its drain a worker still stops vLLM's engine core (up to ~10 s)
BASE_GRACE_S = 30.0  # what `pdd serve` gives every child anyway (topology.STOP_GRACE_S)
ROUTER_READY = "pdd router ready"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    """One process of the topology: its name, datacenter, command line and ready line, and
    how long it may take to stop after SIGTERM (its drain, plus the engine's exit)."""

    name: str
    dc: str
    argv: tuple[str, ...]
    ready_prefix: str
    stop_grace_s: float = field(default=0.0, compare=False)  # timing, not identity


def child_specs(
    cfg: PddConfig, config_path: Path, router_dc: str, python: str = sys.executable
) -> list[ChildSpec]:
    """Every worker (in config order), then the router, each reading ``config_path``.

    With ``security.worker_token_file: auto`` a fresh token is written next to the config
    (see ``auto_token_overrides``) and every child is pointed at it."""
    conf = ("--config", str(config_path), *auto_token_overrides(cfg, config_path.parent))
    specs = [
        ChildSpec(
            w.id,
            w.datacenter,
            (python, "-m", "pdd.launch.worker", *conf, "--worker", w.id),
            WORKER_READY,
            _grace(w.drain_timeout_s),
        )
        for w in cfg.workers
    ]
    specs.append(
        ChildSpec(
            "router",
            router_dc,
            (python, "-m", "pdd.router.main", *conf),
            ROUTER_READY,
            _grace(cfg.router.drain_timeout_s),
        )
    )
    return specs


def _grace(drain_timeout_s: float) -> float:
    """Stop grace a child needs beyond the launcher's own (0: the launcher's is enough)."""
    need = drain_timeout_s + EXIT_MARGIN_S
    return need if need > BASE_GRACE_S else 0.0


def auto_token_overrides(cfg: PddConfig, run_dir: Path) -> tuple[str, ...]:
    """``--set`` arguments that resolve ``security.worker_token_file: auto``: a random token
    (256 bits) in ``run_dir/worker-token`` (mode 0600, written once per run folder). Only the
    path travels on command lines; () when the config names a real file or none."""
    if cfg.security.worker_token_file != AUTO:
        return ()
    path = run_dir / "worker-token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return ("--set", f"security.worker_token_file={path}")


def child_env() -> dict[str, str]:
    """The launcher's environment plus pdd's defaults for what vLLM reads at spawn time."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the launcher dies, whatever kills it."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class Child:
    """One supervised child process and the tail of its output."""

    spec: ChildSpec
    spawn: Spawn = subprocess.Popen
    proc: subprocess.Popen | None = None
    ready_line: str | None = None
    signalled: bool = False  # the launcher asked it to stop (its exit status is then expected)
    killed: bool = False  # it outlived its stop grace and got SIGKILL
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    ready: threading.Event = field(default_factory=threading.Event)
    ready_at: float | None = None  # monotonic time of the current process's ready line
    _terminated_at: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self, env: dict[str, str]) -> None:
        """Spawn the process (from the main thread: see the module docstring)."""
        self.proc = self.spawn(
            list(self.spec.argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
            preexec_fn=die_with_parent,
        )
        pump = threading.Thread(
            target=self._pump, args=(self.proc, self.ready), name=f"pump-{self.name}", daemon=True
        )
        pump.start()

    def restart(self, env: dict[str, str]) -> None:
        """Start the same command line again after the process died (main thread only). The
        new process gets a fresh ready event: a late line of the old one cannot set it."""
        assert not self.alive(), "restart of a running child"
        self.ready, self.ready_line, self.ready_at = threading.Event(), None, None
        self.signalled, self.killed, self._terminated_at = False, False, None
        self.start(env)

    def _pump(self, proc: subprocess.Popen, ready: threading.Event) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if not ready.is_set() and line.startswith(self.spec.ready_prefix):
                self.ready_line, self.ready_at = line, time.monotonic()
                ready.set()
            sys.stderr.write(f"[{self.name}] {line}\n")  # one write: no interleaving
            sys.stderr.flush()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def failed(self) -> bool:
        """Exited with an error of its own (not the signals the launcher sent)."""
        code = self.exit_code
        expected = (0, -signal.SIGTERM, -signal.SIGKILL) if self.signalled else (0,)
        return code is not None and code not in expected

    def terminate(self) -> None:
        """SIGTERM: the child drains (finishes what is in flight), then exits."""
        if self.alive():
            assert self.proc is not None
            self.signalled = True
            self._terminated_at = time.monotonic()
            self.proc.terminate()

    def wait_or_kill(self, deadline_s: float) -> None:
        """Wait until the process is gone, SIGKILL it at the deadline (a monotonic time), or
        later when its drain (``spec.stop_grace_s`` after SIGTERM) needs longer."""
        if self.proc is None:
            return
        if self._terminated_at is not None:
            deadline_s = max(deadline_s, self._terminated_at + self.spec.stop_grace_s)
        try:
            self.proc.wait(timeout=max(0.0, deadline_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.signalled = self.killed = True
            self.proc.kill()
            self.proc.wait(timeout=5)

    def describe_failure(self, what: str) -> str:
        tail = "\n".join(f"    {line}" for line in list(self.tail)[-20:])
        return f"{self.name} {what} (exit code {self.exit_code}); last output:\n{tail}"
