"""`pdd serve` as a process, its children replaced by fakes (tests/launch/fake_child.py): ready
line, health wait, exit status, failure output, SIGTERM and SIGKILL leave nothing running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import REPO, children_of

FAKE_SERVE = str(Path(__file__).with_name("fake_serve.py"))
DEADLINE_S = 30.0


class Launcher:
    """One fake-backed `pdd serve`, its output collected line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        argv = [sys.executable, FAKE_SERVE, "--config", "configs/local.yaml"]
        argv += ["--set", "router.port=0", *args]
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


@pytest.fixture
def launch():
    started: list[Launcher] = []

    def start(*args: str, **env: str) -> Launcher:
        launcher = Launcher(*args, env=env)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill()


def wait_gone(pids: list[int]) -> list[int]:
    """Poll until none of ``pids`` runs (deadline); returns the ones still there."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_ready_url_answers_health_and_sigterm_stops_everything(launch):
    s = launch()
    s.wait_ready()
    r = httpx.get(s.url.removesuffix("/v1") + "/health", timeout=5)
    assert r.status_code == 200
    assert [w["id"] for w in r.json()["workers"]] == ["p", "rld", "md"]
    kids = children_of(s.proc.pid)
    assert len(kids) == 4  # three workers and the router, nothing in between
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 0, s.output()
    assert wait_gone(kids) == []


def test_worker_that_fails_before_ready_fails_serve_with_its_output(launch):
    s = launch(FAKE_MD="crash")
    assert s.wait() == 1
    err = "\n".join(s.stderr)
    assert "pdd serve: md exited before it was ready (exit code 3); last output:" in err
    assert "    md: boom, cannot load the model" in err
    assert not any(x.startswith("pdd ready") for x in s.stdout)


def test_worker_that_dies_while_serving_stops_the_rest_and_fails_serve(launch):
    s = launch(FAKE_RLD="die")
    code = s.wait()
    err = "\n".join(s.stderr)
    assert code == 1, s.output()
    assert "pdd serve: rld died (exit code 4)" in err or "rld exited before it was ready" in err


def test_child_with_an_error_exit_on_the_way_down_fails_serve(launch):
    s = launch(FAKE_P="bad_exit")
    s.wait_ready()
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 1
    assert "pdd serve: p failed (exit code 5)" in "\n".join(s.stderr)


def test_child_ignoring_sigterm_is_killed_and_serve_still_exits_cleanly(launch):
    s = launch(FAKE_ROUTER="stubborn")
    s.wait_ready()
    kids = children_of(s.proc.pid)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 0, s.output()
    assert wait_gone(kids) == []


def test_unhealthy_fleet_is_a_startup_failure(launch):
    s = launch("--ready-timeout", "3", FAKE_ROUTER="unhealthy")
    assert s.wait() == 1
    assert "did not report every worker healthy in time: workers not healthy yet: " in "\n".join(
        s.stderr
    )


def test_children_die_with_a_sigkilled_launcher(launch):
    s = launch()
    s.wait_ready()
    kids = children_of(s.proc.pid)
    assert len(kids) == 4
    s.kill()
    assert wait_gone(kids) == []


def test_unreachable_lab_address_is_refused_before_anything_starts():
    r = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "serve", "--config", "configs/local.yaml"]
        + ["--placement", "lab"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "worker md: host 127.0.0.1 in dc-b cannot be reached from the router in dc-a" in r.stderr
