"""pdd/bench/soak.py end to end, short: a real colocated topology, mixed traffic, a paused
worker, then the leak check. It must run, report its numbers and find zero leaks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_soak_runs_and_reports_no_leaks(tmp_path):
    out = tmp_path / "soak"
    args = [sys.executable, "-m", "pdd.bench.soak", "--config", "configs/colocated.yaml",
            "--duration-s", "30", "--clients", "3", "--fault-interval-s", "8", "--pause-s", "2",
            "--settle-s", "30", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "soak.json").read_text())
    assert (out / "soak.png").stat().st_size > 0
    assert report["leaks"] == {"w0": {}} and report["leaked"] is False
    assert report["failed"] == {}  # every request completed, was dropped by us, or got a 4xx
    assert report["requests_sent"] == (
        report["completed"] + report["client_disconnects"] + report["bad_requests_rejected"]
    )
    assert report["completed"] > 0
    assert report["faults"]["count"] >= 1  # the worker was paused at least once
    assert report["serve_exit_code"] == 0
    assert set(report["rss_mib"]) == {"w0"} and len(report["rss_samples"]) >= 10
