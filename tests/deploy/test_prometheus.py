"""Prometheus configs and rules (deploy/prometheus): structure in Python, the targets they keep
against the fleets they scrape, and promtool's own checks and rule unit tests where promtool is
installed (tests/deploy/install_promtool.sh puts it in the venv)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdd.config import load_config
from tests.deploy.support import DEPLOY, DOCS, REPO, config_of, container, rendered

PROM = DEPLOY / "prometheus"
CONFIGS = {"static": PROM / "prometheus.yml", "kubernetes": PROM / "prometheus-kubernetes.yml"}
RULES = PROM / "rules" / "pdd.rules.yml"
RULES_TEST = Path(__file__).parent / "promtool" / "rules_test.yml"
RELABEL_ACTIONS = {"replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep", "hashmod"}


def _promtool() -> str | None:
    found = shutil.which("promtool") or str(Path(sys.executable).parent / "promtool")
    return found if os.access(found, os.X_OK) else None


needs_promtool = pytest.mark.skipif(
    _promtool() is None,
    reason="promtool not installed (run tests/deploy/install_promtool.sh to unpack Debian's)",
)


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _promtool_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_promtool(), *args], capture_output=True, text=True, timeout=60, cwd=PROM
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_structure(name):
    cfg = _load(CONFIGS[name])
    assert set(cfg) == {"global", "rule_files", "scrape_configs"}
    for rule_file in cfg["rule_files"]:
        assert (CONFIGS[name].parent / rule_file).resolve() == RULES
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert sorted(jobs) == ["pdd-router", "pdd-workers"]
    for job in jobs.values():
        # The router's pdd_worker_* series keep the worker's own `role` label.
        assert job["honor_labels"] is True
        for rule in job.get("relabel_configs", []):
            assert rule.get("action", "replace") in RELABEL_ACTIONS
            re.compile(rule.get("regex", "(.*)"))


def test_static_config_scrapes_exactly_the_systemd_fleet():
    fleet = load_config(DEPLOY / "systemd" / "pdd.yaml")
    jobs = {j["job_name"]: j for j in _load(CONFIGS["static"])["scrape_configs"]}
    (router,) = jobs["pdd-router"]["static_configs"]
    assert router == {
        "targets": [f"{fleet.router.host}:{fleet.router.port}"],
        "labels": {"role": "router", "datacenter": "dc-a"},
    }
    scraped = {
        (t, g["labels"]["role"], g["labels"]["datacenter"])
        for g in jobs["pdd-workers"]["static_configs"]
        for t in g["targets"]
    }
    assert scraped == {
        (f"{w.host}:{w.metrics_port}", w.role.value, w.datacenter) for w in fleet.workers
    }


def _meta_labels(pod: dict, port: dict) -> dict[str, str]:
    """What kubernetes_sd (role: pod) gives one container port of a pod."""
    labels = {
        "__address__": f"10.0.0.1:{port['containerPort']}",
        "__meta_kubernetes_namespace": pod["metadata"]["namespace"],
        "__meta_kubernetes_pod_name": pod["metadata"]["name"],
        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
    }
    for key, value in pod["metadata"]["labels"].items():
        labels["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    return labels


def _relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str] | None:
    """Prometheus relabeling (keep / replace, the actions the config uses)."""
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep" and match is None:
            return None
        if action == "replace" and match is not None:
            out = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
            labels[rule["target_label"]] = out
        assert action in ("keep", "replace"), action
    return {k: v for k, v in labels.items() if not k.startswith("__") and v}


def test_kubernetes_config_keeps_the_metrics_port_of_every_pdd_pod(tmp_path):
    objs = rendered("dc-a")
    jobs = {j["job_name"]: j for j in _load(CONFIGS["kubernetes"])["scrape_configs"]}
    kept: dict[str, set] = {name: set() for name in jobs}
    for obj in objs:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = {
            "metadata": {
                "name": f"{obj['metadata']['name']}-0",
                "namespace": obj["metadata"]["namespace"],
                "labels": obj["spec"]["template"]["metadata"]["labels"],
            }
        }
        for port in container(obj)["ports"]:
            for name, job in jobs.items():
                target = _relabel(_meta_labels(pod, port), job["relabel_configs"])
                if target is not None:
                    kept[name].add((port["name"], target["role"], target["datacenter"]))
    assert kept == {
        "pdd-router": {("http", "router", "dc-a")},
        "pdd-workers": {("metrics", "prefill", "dc-a"), ("metrics", "relay_decode", "dc-a")},
    }
    # Datacenter B's MainDecode pods: through the addresses datacenter A's config dials.
    md = [w for w in config_of(objs, tmp_path).workers if w.role.value == "main_decode"]
    (remote,) = jobs["pdd-workers"]["static_configs"]
    assert remote == {
        "targets": [f"{w.host}:{w.metrics_port}" for w in md],
        "labels": {"role": "main_decode", "datacenter": "dc-b"},
    }


def test_rules_read_only_the_documented_metrics():
    """Every metric the rules read is in docs/operations.md's table; built ones exist in pdd."""
    rules = _load(RULES)
    exprs = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    used = set(re.findall(r"\b(pdd_[a-z_]+)\b", exprs))
    rows = re.findall(
        r"^\| `(pdd_[a-z_]+)(?:\{[^`]*\})?` \| (built|planned) \|", DOCS.read_text(), re.M
    )
    documented = dict(rows)
    assert used <= set(documented), sorted(used - set(documented))
    assert all(name.startswith("pdd:") for name in recorded)
    source = "\n".join(p.read_text() for p in (REPO / "pdd").rglob("*.py"))
    for name, status in documented.items():
        base = re.sub(r"_(total|bucket)$", "", name)
        defined = f'"{base}"' in source
        assert defined == (status == "built"), (
            f"{name}: docs say {status}; pdd defines it: {defined}"
        )


@needs_promtool
def test_promtool_checks_the_static_config_and_rules():
    result = _promtool_run("check", "config", CONFIGS["static"].name)
    assert result.returncode == 0, result.stdout + result.stderr
    result = _promtool_run("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 18 rules found" in result.stdout


@needs_promtool
def test_promtool_checks_the_kubernetes_config(tmp_path):
    """Debian's promtool is built without Kubernetes discovery, so the discovery blocks are
    swapped for static targets; everything else (jobs, relabeling, rule files) is checked."""
    cfg = _load(CONFIGS["kubernetes"])
    for job in cfg["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["static_configs"] = [{"targets": ["127.0.0.1:9"]}]
    checked = PROM / f".promtool-{os.getpid()}.yml"  # rule_files resolve beside the config
    checked.write_text(yaml.safe_dump(cfg))
    try:
        result = _promtool_run("check", "config", checked.name)
    finally:
        checked.unlink()
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_recording_rules_compute_goodput_cost_and_bcr():
    result = _promtool_run("test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
