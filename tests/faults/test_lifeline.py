"""pdd.engine.lifeline: a multiprocessing child (as vLLM's engine core is) dies with its parent
when the parent is SIGKILLed, for every start method; without a parent there is nothing to do.
The real engine core is checked in tests/faults/test_worker_loss.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pdd.engine.lifeline import start_lifeline
from tests.faults.topology import pid_alive
from tests.helpers import wait_until


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_child_dies_within_seconds_of_its_parent_sigkill(method):
    parent = subprocess.Popen(
        [sys.executable, "-m", "tests.faults.lifeline_child", method], stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    child = 0
    try:
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        wait_until(lambda: not pid_alive(child), 5, f"the {method} child {child} exited")
    finally:
        if child and pid_alive(child):
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_no_parent_no_lifeline():
    assert start_lifeline() is False
