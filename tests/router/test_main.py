"""`pdd router` as a process: ready line, signals, exit codes, and no torch/vLLM imports."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tests.helpers import REPO

ENV = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")


def test_router_never_imports_torch_vllm_or_numpy():
    code = (
        "import importlib, pkgutil, sys, pdd.router\n"
        "for m in pkgutil.iter_modules(pdd.router.__path__):\n"
        "    importlib.import_module('pdd.router.' + m.name)\n"
        "bad = sorted(n for n in ('torch', 'vllm', 'transformers', 'numpy') if n in sys.modules)\n"
        "print('loaded:', bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded: []"


class Proc:
    """A `python -m pdd.router.main` child with its stdout read in a thread."""

    def __init__(self, *args: str):
        self.p = subprocess.Popen(
            [sys.executable, "-m", "pdd.router.main", *args], cwd=REPO, env=ENV,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, timeout: float = 60) -> str | None:
        return self.lines.get(timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise


@pytest.fixture
def config_file(tmp_path, codec):
    path = tmp_path / "router.yaml"
    path.write_text("router:\n  port: 0\n  health_interval_s: 0.1\nworkers: []\n")
    return str(path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_ready_line_serves_and_exits_zero_on_signal(config_file, sig):
    proc = Proc("--config", config_file, "--set", "router.max_body_bytes=1000")
    try:
        line = proc.next_line()
        assert line is not None and line.startswith("pdd router ready: http://127.0.0.1:")
        url = line.removeprefix("pdd router ready: ")
        assert url.endswith("/v1") and not url.endswith(":0/v1")
        assert httpx.get(url + "/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 503
        cfg = httpx.get(url.removesuffix("/v1") + "/debug/config").json()
        assert cfg["router"]["max_body_bytes"] == 1000
        r = httpx.post(url + "/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        code = proc.stop(sig)
    assert code == 0, proc.p.stderr.read()  # type: ignore[union-attr]
    assert proc.next_line(5) is None  # exactly one line on stdout


def test_bad_config_exits_2_without_ready_line(config_file):
    proc = Proc("--config", config_file, "--set", "router.bogus=1")
    assert proc.p.wait(timeout=60) == 2
    assert proc.next_line(5) is None
    assert "router.bogus: unknown key" in proc.p.stderr.read()  # type: ignore[union-attr]


def test_missing_model_folder_exits_2(config_file, tmp_path):
    proc = Proc("--config", config_file, "--set", f"model.path={tmp_path / 'none'}")
    assert proc.p.wait(timeout=60) == 2
    assert "no tokenizer.json" in proc.p.stderr.read()  # type: ignore[union-attr]
