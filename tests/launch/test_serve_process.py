"""`pdd serve` as a process, its children replaced by fakes (tests/launch/fake_child.py): ready
line, health wait, exit status, failure output, SIGTERM and SIGKILL leave nothing running."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import REPO, children_of
from tests.launch.support import Launcher, wait_gone


@pytest.fixture
def launch():
    started: list[Launcher] = []

    def start(*args: str, **env: str) -> Launcher:
        launcher = Launcher("configs/local.yaml", "--set", "router.port=0", *args, env=env)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill()


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


FAST_RESTARTS = ("--set", "launch.restart_backoff_s=0.1")


def test_worker_that_fails_before_ready_fails_serve_with_its_output(launch):
    s = launch(*FAST_RESTARTS, FAKE_MD="crash")
    assert s.wait() == 1
    err = "\n".join(s.stderr)
    assert "pdd serve: md exited before it was ready (exit code 3); last output:" in err
    assert "    md: boom, cannot load the model" in err
    # started launch.max_failed_starts (3) times, then given up with its error
    assert [x for x in s.stderr if x == "[md] md: boom, cannot load the model"] == [
        "[md] md: boom, cannot load the model"
    ] * 3
    assert "gave up on md after 3 failed starts in a row (launch.max_failed_starts)" in err
    assert not any(x.startswith("pdd ready") for x in s.stdout)


def _wait_for(predicate, what: str, s, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert s.proc.poll() is None, s.output()
        assert time.monotonic() < deadline, f"{what}: {s.output()}"
        time.sleep(0.05)


@pytest.mark.parametrize("who", ["rld", "router"])
def test_child_that_dies_while_serving_is_restarted_and_the_rest_keep_running(launch, who):
    s = launch(*FAST_RESTARTS, **{f"FAKE_{who.upper()}": "die_once"})
    s.wait_ready()
    ready_line = "pdd router ready" if who == "router" else "pdd worker ready"
    started = lambda: [x for x in s.stderr if x.startswith(f"[{who}] {ready_line}")]  # noqa: E731
    _wait_for(lambda: len(started()) == 2, f"{who} started again", s)
    err = "\n".join(s.stderr)
    assert (
        f"{who} died (exit code 4)" in err and f"starting {who} again in 0.1 s (restart 1)" in err
    )
    _wait_for(lambda: len(children_of(s.proc.pid)) == 4, "four children again", s)
    r = httpx.get(s.url.removesuffix("/v1") + "/health", timeout=5)
    assert r.status_code == 200
    kids = children_of(s.proc.pid)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 0, s.output()  # asked to stop, everything stopped cleanly
    assert wait_gone(kids) == []


def test_worker_that_dies_with_restarts_off_stops_the_rest_and_fails_serve(launch):
    s = launch("--set", "launch.restart=false", FAKE_RLD="die")
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
