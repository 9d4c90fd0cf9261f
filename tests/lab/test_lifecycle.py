"""Up, down and crashes: whatever ends a lab, nothing it made is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdd.config.lab import LabConfig
from pdd.errors import LabError
from pdd.lab import Lab, topology
from pdd.lab.netns import pid_alive
from tests.lab.support import needs_lab

pytestmark = [pytest.mark.lab, needs_lab]

PREFIX, SUBNET = "pdtlife", "10.77.1.32/28"
CLEAN_DEADLINE_S = 15.0


@pytest.fixture
def lab():
    """A lab this test brings up; brought down afterwards whatever the test did to it."""
    lab = Lab(LabConfig(prefix=PREFIX, subnet=SUBNET, delay_ms=2, rate_mbit=50))
    yield lab
    lab.down()
    assert topology.leftovers(lab.plan) == []


def _wait_until_gone(lab: Lab, pids: list[int]) -> None:
    """Poll until nothing of the lab exists and none of ``pids`` runs, within the deadline."""
    deadline = time.monotonic() + CLEAN_DEADLINE_S
    while True:
        left = topology.leftovers(lab.plan) + [p for p in pids if pid_alive(p)]
        if not left and not lab.plan.state_dir.exists():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"still there after {CLEAN_DEADLINE_S} s: {left}\n{lab.log_tail()}")
        time.sleep(0.05)


def _sleeper(lab: Lab, dc: str) -> subprocess.Popen:
    return lab.spawn_in(dc, ["sleep", "600"])


def test_down_removes_everything_and_stops_processes_inside(lab):
    st = lab.up()
    sleeper = _sleeper(lab, "dc-a")
    assert sorted(os.listdir(lab.plan.state_dir)) == [
        "config.json",
        "relay.pid",
        "status.json",
        "supervisor.pid",
    ]
    lab.down()
    assert topology.leftovers(lab.plan) == []
    assert not lab.plan.state_dir.exists()
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    assert not pid_alive(st.supervisor_pid) and not pid_alive(st.relay_pid)
    assert lab.status().state == "down"


def test_relay_crash_removes_everything(lab):
    st = lab.up()
    sleeper = _sleeper(lab, "dc-b")
    os.kill(st.relay_pid, signal.SIGKILL)
    _wait_until_gone(lab, [st.supervisor_pid, st.relay_pid])
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    assert "relay exited unexpectedly (exit -9): removing the lab" in lab.log_tail()


def test_supervisor_crash_removes_everything(lab):
    st = lab.up()
    os.kill(st.supervisor_pid, signal.SIGKILL)
    _wait_until_gone(lab, [st.supervisor_pid, st.relay_pid])
    assert "supervisor is gone: removing the lab" in lab.log_tail()


def test_up_twice_is_refused_and_down_twice_is_fine(lab):
    lab.up()
    with pytest.raises(LabError, match="already up"):
        lab.up()
    assert lab.status().state == "up"
    lab.down()
    lab.down()
    assert lab.status().state == "down"


def test_leftovers_show_as_broken_and_up_replaces_them(lab):
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-dc-a"], check=True)
    st = lab.status()
    assert st.state == "broken" and st.problems == [f"{PREFIX}-dc-a exists"]
    assert lab.up().state == "up"


def test_a_second_lab_on_a_taken_subnet_is_refused_and_leaves_nothing(lab):
    lab.up()
    other = Lab(LabConfig(prefix="pdtother", subnet=SUBNET))
    with pytest.raises(LabError, match=f"subnet {SUBNET} is in use"):
        other.up()
    assert topology.leftovers(other.plan) == []
    assert other.status().state == "down"
    assert lab.status().state == "up"


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pdd.cli", "lab", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_cli_up_status_exec_down(lab):
    where = ["--prefix", PREFIX]
    up = _cli(
        "up", *where, "--subnet", SUBNET, "--delay-ms", "5", "--rate-mbit", "50", "--seconds", "0.5"
    )
    assert up.returncode == 0, up.stderr
    assert "lab pdtlife: up" in up.stdout and "measured rtt" in up.stdout
    status = _cli("status", *where, "--no-measure")
    assert status.returncode == 0
    assert "delay 5 ms each way, rate 50 Mbit/s" in status.stdout
    assert _cli("exec", *where, "dc-a", "--", "sh", "-c", "exit 3").returncode == 3
    assert _cli("down", *where).returncode == 0
    down = _cli("status", *where)
    assert (down.returncode, down.stdout.strip()) == (1, "lab pdtlife: down")
