"""Bytes that really crossed the emulated WAN, read from the lab's link counters.

The router's per-request ``wan_kv_bytes`` is what P *queued* for MD; a transfer cancelled
mid-way (RLD finished first) queued more than crossed, and gRPC/token traffic is not counted.
``LinkMeter`` reads the kernel's byte counters of the lab's WAN device in both datacenters
(``/sys/class/net/wan0/statistics/tx_bytes`` inside PREFIX-dc-a and PREFIX-dc-b): every IP
byte, both directions, whatever sent it. The benchmark reads it before and after each measured
phase; nothing else should use the lab meanwhile.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from pdd.errors import LabError
from pdd.lab.plan import WAN_IFNAME

_DCS = ("dc-a", "dc-b")


class LinkMeter:
    """Total bytes sent on the lab ``prefix``'s WAN, both directions."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def _counter(self, dc: str) -> int:
        path = Path("/sys/class/net") / WAN_IFNAME / "statistics" / "tx_bytes"
        cmd = ["ip", "netns", "exec", f"{self.prefix}-{dc}", "cat", str(path)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
            return int(out.stdout.strip())
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            raise LabError(
                f"cannot read the WAN byte counter of lab {self.prefix!r} ({dc}): {exc}; "
                f"is the lab up (`pdd lab status --prefix {self.prefix}`)?"
            ) from exc

    def read(self) -> int:
        return sum(self._counter(dc) for dc in _DCS)
