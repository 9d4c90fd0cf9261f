"""`pdd serve` fails loudly and cleanly: a child that cannot start (after its retries) makes it
exit non-zero with the child's error, and nothing is left running."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def run_serve(*overrides: str, timeout: float = 180) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pdd.cli", "serve", "--config", "configs/colocated.yaml"]
    for o in ("router.port=0", *overrides):
        args += ["--set", o]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_missing_model_folder_fails_with_its_path(tmp_path):
    missing = tmp_path / "no-such-model"
    r = run_serve(f"model.path={missing}", "launch.restart_backoff_s=0.1",
                  "launch.max_failed_starts=2")  # fmt: skip
    assert r.returncode == 1
    assert str(missing) in r.stderr
    assert "pdd ready" not in r.stdout
    # the worker was started launch.max_failed_starts (2) times, then pdd serve gave up
    assert r.stderr.count("starting w0 again") == 1
    assert "gave up on w0 after 2 failed starts in a row (launch.max_failed_starts)" in r.stderr


def test_bad_config_key_is_rejected_before_anything_starts():
    r = run_serve("router.bogus=1", timeout=60)
    assert r.returncode == 2
    assert "router.bogus: unknown key" in r.stderr
