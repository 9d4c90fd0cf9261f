"""Shared pieces of the lab tests: why a lab cannot run here, and a lab that cleans up.

Each test module runs its own lab with its own prefix and subnet (inside 10.77.1.0/24), so
the tests never touch a user's lab (prefix pdd, 10.77.0.0/28).
"""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

from pdd.config.lab import LabConfig
from pdd.lab import Lab, topology


def why_no_lab() -> str | None:
    """The reason this machine cannot run a lab, or None."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, TUN devices, tc); CI runs it as root"
    if not os.path.exists("/dev/net/tun"):
        return "the kernel has no /dev/net/tun, so the WAN relay cannot run"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: apt-get install -y iproute2"
    return None


needs_lab = pytest.mark.skipif(why_no_lab() is not None, reason=str(why_no_lab()))


@contextlib.contextmanager
def running_lab(**fields):
    """Bring a lab up, yield it, bring it down and check that nothing of it is left."""
    lab = Lab(LabConfig(**fields))
    lab.up()
    try:
        yield lab
    finally:
        lab.down()
        assert topology.leftovers(lab.plan) == []
        assert not lab.plan.state_dir.exists()
