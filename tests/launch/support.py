"""Shared by the launcher tests: a fake-backed `pdd serve` process, and process checks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers import REPO

FAKE_SERVE = str(Path(__file__).with_name("fake_serve.py"))
DEADLINE_S = 30.0


class Launcher:
    """One fake-backed `pdd serve`, its output collected line by line."""

    def __init__(self, config: str, *args: str, env: dict[str, str] | None = None):
        argv = [sys.executable, FAKE_SERVE, "--config", config, *args]
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=dict(os.environ, **(env or {})), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.ready = threading.Event()
        self._pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for t in self._pumps:
            t.start()

    def _pump(self, stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))
            if line.startswith("pdd ready: "):
                self.ready.set()

    @property
    def url(self) -> str:
        return next(x for x in self.stdout if x.startswith("pdd ready: ")).split(": ", 1)[1]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not self.ready.wait(0.05):
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()

    def wait(self) -> int:
        try:
            code = self.proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        for t in self._pumps:  # they end at EOF, once the launcher is gone
            t.join(timeout=DEADLINE_S)
        return code

    def output(self) -> str:
        return "\n".join(self.stdout + ["--- stderr"] + self.stderr)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_gone(pids: list[int]) -> list[str]:
    """Poll until none of ``pids`` runs (deadline); returns the ones still there, each as
    ``pid state ppid cmdline`` (what a failure has to show: which process outlived its
    parent, and who holds it)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return [_describe(p) for p in alive]
        time.sleep(0.05)


def _stat(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ...]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False


def _describe(pid: int) -> str:
    try:
        state, ppid = _stat(pid)[:2]
        return f"{pid} {state} ppid={ppid} {' '.join(cmdline(pid))}"
    except OSError:
        return f"{pid} (gone)"


def netns_of(pid: int) -> int:
    """The inode of a process's network namespace (compare with ``netns_inode``)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def direct_children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]
