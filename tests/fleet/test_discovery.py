"""DNS discovery of a headless service with a fake resolver: addresses become workers, new
ones join, vanished ones leave, a failed lookup changes nothing."""

from __future__ import annotations

import asyncio

import pytest

from pdd.config import PddConfig
from pdd.config.fleet import DnsDiscoveryConfig
from pdd.errors import InvalidRequestError
from pdd.protocol import Role
from pdd.router.fleet.discovery import DnsDiscovery, sync
from pdd.router.fleet.pool import WorkerPool

ENTRY = DnsDiscoveryConfig(name="pdd-md.pdd.svc.cluster.local", role=Role.MAIN_DECODE,
                           port=50051, datacenter="dc-b")  # fmt: skip


def pool() -> WorkerPool:
    cfg = PddConfig.model_validate({
        "router": {"mode": "pdd"},
        "workers": [{"id": "p0", "role": "prefill", "port": 7000}],
    })  # fmt: skip
    return WorkerPool(cfg)


def fleet_of(p: WorkerPool) -> dict[str, tuple[str, str, int, str]]:
    return {w.id: (w.role.value, w.datacenter, w.max_num_seqs, w.source) for w in p.view().workers}


class FakeResolver:
    """Answers from a script; an OSError in it stands for a failed lookup."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.asked.append((name, port))
        answer = self.answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer


def test_records_become_workers_and_follow_the_answers():
    p = pool()
    resolver = FakeResolver(["10.0.1.7", "10.0.1.9"], OSError("SERVFAIL"), ["10.0.1.9",
                            "10.0.1.12"], [])  # fmt: skip
    disco = DnsDiscovery(p, [ENTRY], resolver)

    async def run() -> list[list[str]]:
        return [await disco.refresh(ENTRY) for _ in range(4)]

    assert asyncio.run(run()) == [
        ["+pdd-md-10.0.1.7", "+pdd-md-10.0.1.9"],
        [],  # SERVFAIL: keep what we had
        ["-pdd-md-10.0.1.7", "+pdd-md-10.0.1.12"],
        ["-pdd-md-10.0.1.12", "-pdd-md-10.0.1.9"],  # no ready pod left
    ]
    assert resolver.asked == [("pdd-md.pdd.svc.cluster.local", 50051)] * 4
    assert fleet_of(p) == {"p0": ("prefill", "dc-a", 32, "config")}


def test_discovered_workers_join_the_view_and_drc_views():
    p = pool()
    assert sync(p, ENTRY, ["10.0.1.7"]) == ["+pdd-md-10.0.1.7"]
    assert sync(p, ENTRY, ["10.0.1.7"]) == []  # unchanged
    assert fleet_of(p)["pdd-md-10.0.1.7"] == ("main_decode", "dc-b", 0, "dns:" + ENTRY.name)
    assert p.members("dns:" + ENTRY.name)["pdd-md-10.0.1.7"].host == "10.0.1.7"
    assert p.drc is not None and p.drc.describe("pdd-md-10.0.1.7")["stale"] is True
    named = ENTRY.model_copy(update={"id_prefix": "md"})
    assert sync(p, named, ["10.0.1.8"]) == ["-pdd-md-10.0.1.7", "+md-10.0.1.8"]  # same name


def test_a_discovered_id_never_replaces_a_configured_worker():
    p = pool()
    moved = p.members("config")["p0"].model_copy(update={"port": 1})
    with pytest.raises(InvalidRequestError, match="already in the fleet"):
        p.add(moved, "dns:x")
    assert p.remove("p0", "a config worker stays") is False
    assert fleet_of(p)["p0"][3] == "config"


def test_the_shipped_kubernetes_discovery_example_loads_and_matches_its_services():
    """deploy/k8s/discovery: the router block merged into dc-a's config (listed P and RLD
    removed) is a valid config, and each DNS name is a ready-only headless Service that
    selects the pods of the entry's role."""
    import yaml

    from pdd.config import PddConfig, read_yaml_mapping
    from tests.helpers import REPO

    root = f"{REPO}/deploy/k8s"
    data = read_yaml_mapping(f"{root}/overlays/dc-a/pdd.yaml")
    data["router"]["fleet"] = read_yaml_mapping(f"{root}/discovery/router-fleet.yaml")["router"][
        "fleet"
    ]
    data["workers"] = [w for w in data["workers"] if w["role"] == "main_decode"]
    cfg = PddConfig.model_validate(data)
    with open(f"{root}/discovery/ready-services.yaml") as f:
        services = {s["metadata"]["name"]: s for s in yaml.safe_load_all(f)}
    assert [e.role for e in cfg.router.fleet.dns] == [Role.PREFILL, Role.RELAY_DECODE]
    for entry in cfg.router.fleet.dns:
        service, namespace = entry.name.split(".")[:2]
        spec = services[service]["spec"]
        assert (namespace, spec["clusterIP"], spec["publishNotReadyAddresses"]) == (
            "pdd", "None", False)  # fmt: skip
        assert spec["selector"]["pdd/role"] == entry.role.value
        assert spec["ports"][0]["port"] == entry.port
