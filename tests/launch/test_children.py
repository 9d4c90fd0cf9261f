"""What each child of `pdd serve` runs, and where."""

from __future__ import annotations

import sys
from pathlib import Path

from pdd.config import LabConfig, load_config
from pdd.launch.children import ROUTER_READY, WORKER_READY, ChildSpec, child_env, child_specs
from pdd.launch.lab_sites import planned_sites
from pdd.launch.placement import place

CONF = Path("/run/x/effective-config.yaml")


def test_one_child_per_worker_then_the_router_each_in_its_datacenter():
    placed = place(load_config("configs/lab.yaml"), planned_sites(LabConfig()))
    specs = child_specs(placed.cfg, CONF, placed.router_dc, python="/py")
    conf = ("--config", str(CONF))
    assert specs == [
        ChildSpec("p", "dc-a", ("/py", "-m", "pdd.launch.worker", *conf, "--worker", "p"), WORKER_READY),
        ChildSpec("rld", "dc-a", ("/py", "-m", "pdd.launch.worker", *conf, "--worker", "rld"), WORKER_READY),
        ChildSpec("md", "dc-b", ("/py", "-m", "pdd.launch.worker", *conf, "--worker", "md"), WORKER_READY),
        ChildSpec("router", "dc-a", ("/py", "-m", "pdd.router.main", *conf), ROUTER_READY),
    ]  # fmt: skip


def test_default_python_is_the_launchers_own():
    spec = child_specs(load_config("configs/colocated.yaml"), CONF, "dc-a")[0]
    assert spec.argv[0] == sys.executable


def test_child_env_keeps_the_operators_values(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "10.0.0.9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    env = child_env()
    assert env["VLLM_HOST_IP"] == "10.0.0.9"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"
