"""Helpers shared by the transfer suites (no fixtures here; see conftest.py)."""

from __future__ import annotations

import time

KINDS = ["inproc", "tcp", "ucx"]


def wait_for(pred, timeout_s: float = 10.0, what: str = "condition"):
    """Poll `pred` until truthy or fail after `timeout_s` (never sleep for readiness)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.005)


def idle(t) -> bool:
    s = t.stats()
    return (s.open_outbound, s.pinned_buffers, s.open_inbound, s.lent_buffers) == (0, 0, 0, 0)
