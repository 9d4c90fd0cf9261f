"""`pdd serve` itself (pdd.launch.cli.main: signals, supervision, exit status) with every child
replaced by tests/launch/fake_child.py. Test-only: ``python fake_serve.py SERVE-ARGS...``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pdd.launch.topology
from pdd.launch import cli
from pdd.launch.lab_sites import LabSites
from pdd.launch.placement import LocalSites

FAKE = str(Path(__file__).with_name("fake_child.py"))


def fake_argv(argv: list[str]) -> list[str]:
    """[python, -m, pdd.launch.worker|pdd.router.main, ...] -> [python, fake_child.py, kind, ...]"""
    kind = "router" if argv[2] == "pdd.router.main" else "worker"
    return [argv[0], FAKE, kind, *argv[3:]]


def fake_spawn(argv, **kwargs):
    return subprocess.Popen(fake_argv(argv), **kwargs)


_lab_spawn_for = LabSites.spawn_for


def lab_spawn_for(self, dc):
    spawn = _lab_spawn_for(self, dc)  # the real one: inside the datacenter's namespace
    return lambda argv, **kwargs: spawn(fake_argv(argv), **kwargs)


if __name__ == "__main__":
    LocalSites.spawn_for = lambda self, dc: fake_spawn
    LabSites.spawn_for = lab_spawn_for
    pdd.launch.topology.STOP_GRACE_S = 1.0
    sys.exit(cli.main(sys.argv[1:]))
