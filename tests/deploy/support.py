"""Shared helpers of the deploy tests: paths, rendered overlays, CLI flags, quantities."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from pdd.config import PddConfig, load_config
from tests.deploy.kustomize import render

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = {"dc-a": K8S / "overlays" / "dc-a", "dc-b": K8S / "overlays" / "dc-b"}
DOCS = REPO / "docs" / "operations.md"

# CLI command of a worker container -> the role its pods must have.
COMMAND_ROLE = {"prefill": "prefill", "relay-decode": "relay_decode", "main-decode": "main_decode"}


def rendered(dc: str) -> list[dict[str, Any]]:
    return render(OVERLAYS[dc])


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def config_of(objects: list[dict[str, Any]], tmp_path: Path, overrides=()) -> PddConfig:
    """Load the ConfigMap's pdd.yaml the way a process does: a file, then --set overrides."""
    text = by_kind(objects, "ConfigMap")["pdd-config"]["data"]["pdd.yaml"]
    path = tmp_path / "pdd.yaml"
    path.write_text(text)
    return load_config(path, list(overrides))


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec(workload)["containers"]
    return only


def port(container_: dict[str, Any], name: str) -> int:
    for p in container_["ports"]:
        if p["name"] == name:
            return int(p["containerPort"])
    raise KeyError(f"container {container_['name']} has no port named {name!r}")


def set_overrides(args: list[str], env: dict[str, str]) -> list[str]:
    """The ``--set`` values of an argv, with Kubernetes' $(VAR) expansion applied."""
    out = []
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--set":
            out.append(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value))
    return out


@functools.cache
def cli_flags(command: str) -> frozenset[str]:
    """The long options ``pdd COMMAND --help`` lists (the real parser's, not a copy)."""
    out = subprocess.run(
        [sys.executable, "-m", "pdd.cli", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO,
    ).stdout
    return frozenset(re.findall(r"(--[a-z][a-z-]*)", out))


def gib(quantity: str) -> float:
    """A Kubernetes binary memory quantity (Mi, Gi, Ti) in GiB."""
    units = {"Mi": 1 / 1024, "Gi": 1.0, "Ti": 1024.0}
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(Mi|Gi|Ti)", quantity).groups()
    return float(number) * units[unit]
