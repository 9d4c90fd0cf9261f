"""`pdd serve` placing a topology in the lab (fake children, no engine): each process in its
datacenter's namespace, the printed URL reachable from the host, and every process and the
lab it brought up gone after SIGTERM; a running lab is used as it is and left up."""

from __future__ import annotations

import signal

import httpx
import pytest

from pdd.config.lab import LabConfig
from pdd.lab import Lab, topology
from tests.helpers import children_of
from tests.lab.support import needs_lab, running_lab
from tests.launch.support import (
    Launcher,
    cmdline,
    direct_children,
    netns_inode,
    netns_of,
    wait_gone,
)

pytestmark = [pytest.mark.lab, needs_lab]

PREFIX, SUBNET = "pdtfake", "10.77.2.64/28"
SETS = ["--set", f"lab.prefix={PREFIX}", "--set", f"lab.subnet={SUBNET}"]
DC_A, DC_B = f"{PREFIX}-dc-a", f"{PREFIX}-dc-b"


@pytest.fixture
def lab():
    lab = Lab(LabConfig(prefix=PREFIX, subnet=SUBNET))
    lab.down()  # leftovers of an earlier run
    yield lab
    lab.down()
    assert topology.leftovers(lab.plan) == []


@pytest.fixture
def launch():
    started: list[Launcher] = []

    def start(*args: str) -> Launcher:
        launcher = Launcher("configs/lab.yaml", *SETS, *args)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill()


def placement_of(pid: int) -> dict[str, tuple[str, int]]:
    """name -> (module, namespace inode) of every direct child of `pdd serve`."""
    out = {}
    for child in direct_children(pid):
        argv = cmdline(child)
        name = argv[argv.index("--worker") + 1] if "--worker" in argv else "router"
        out[name] = (argv[2], netns_of(child))  # argv[1] is fake_child.py: no `ip` in front
    return out


def test_serve_brings_the_lab_up_places_each_process_and_takes_it_down(lab, launch):
    s = launch()
    s.wait_ready()
    assert s.url == "http://10.77.2.70:8000/v1"  # dc-a's management address
    health = httpx.get("http://10.77.2.70:8000/health", timeout=5)
    assert health.status_code == 200
    a, b = netns_inode(DC_A), netns_inode(DC_B)
    assert placement_of(s.proc.pid) == {
        "p": ("worker", a),
        "rld": ("worker", a),
        "md": ("worker", b),
        "router": ("router", a),
    }
    kids = children_of(s.proc.pid)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 0, s.output()
    assert wait_gone(kids) == []
    assert lab.status().state == "down"
    assert topology.leftovers(lab.plan) == []
    assert f"taking lab {PREFIX} down" in "\n".join(s.stderr)


def test_serve_uses_a_running_lab_warns_about_its_link_and_leaves_it_up(launch):
    with running_lab(prefix=PREFIX, subnet=SUBNET, delay_ms=3, rate_mbit=50) as lab:
        s = launch()
        s.wait_ready()
        kids = children_of(s.proc.pid)
        assert len(kids) == 4
        err = "\n".join(s.stderr)
        assert f"lab {PREFIX} runs with delay_ms=3.0 (config: 10.0); using it as it is" in err
        assert f"lab {PREFIX} runs with rate_mbit=50.0 (config: 100.0)" in err
        s.kill()  # SIGKILL: the children die with it (PR_SET_PDEATHSIG across ip netns exec)
        assert wait_gone(kids) == []
        assert lab.status().state == "up"
