"""The Kubernetes manifests (deploy/k8s): rendered per datacenter, validated against the
Kubernetes schemas offline, and checked against the pdd config they carry."""

from __future__ import annotations

import copy
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from pdd.cli import COMMANDS
from tests.deploy.kustomize import render
from tests.deploy.support import (
    COMMAND_ROLE,
    K8S,
    OVERLAYS,
    by_kind,
    cli_flags,
    config_of,
    container,
    gib,
    pod_spec,
    port,
    rendered,
    set_overrides,
)

K8S_VERSION = "1.32.0"
POD_IP = "10.1.2.3"


@pytest.fixture(scope="module")
def objs() -> dict[str, list[dict]]:
    return {dc: rendered(dc) for dc in OVERLAYS}


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def test_each_datacenter_renders_its_roles(objs):
    assert sorted(_key(o) for o in objs["dc-a"]) == [
        ("ConfigMap", "pdd-config"),
        ("Deployment", "pdd-router"),
        ("Namespace", "pdd"),
        ("Service", "pdd-prefill"),
        ("Service", "pdd-relay-decode"),
        ("Service", "pdd-router"),
        ("StatefulSet", "pdd-prefill"),
        ("StatefulSet", "pdd-relay-decode"),
    ]
    assert sorted(_key(o) for o in objs["dc-b"]) == [
        ("ConfigMap", "pdd-config"),
        ("Namespace", "pdd"),
        ("Service", "pdd-main-decode"),
        ("Service", "pdd-main-decode-0-wan"),
        ("Service", "pdd-main-decode-1-wan"),
        ("StatefulSet", "pdd-main-decode"),
    ]
    for obj in objs["dc-a"] + objs["dc-b"]:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "pdd", _key(obj)


@pytest.mark.parametrize("dc", sorted(OVERLAYS))
def test_every_object_validates_against_the_kubernetes_schema(objs, dc):
    for obj in objs[dc]:
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == "1.32", _key(obj)


def test_schema_validation_catches_a_misspelled_field(objs):
    router = copy.deepcopy(by_kind(objs["dc-a"], "Deployment")["pdd-router"])
    container(router)["readinessProbe"]["httpGet"]["prot"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError, match="prot"):
        kubernetes_validate.validate(router, K8S_VERSION, strict=True)


@pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl is not on PATH: the renderer cannot be compared with `kubectl kustomize` "
    "(every rendered object is still schema-validated by the other tests)",
)
@pytest.mark.parametrize("dc", sorted(OVERLAYS))
def test_renderer_matches_kubectl_kustomize(objs, dc):
    out = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAYS[dc])],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]
    assert sorted(objs[dc], key=_key) == sorted(theirs, key=_key)


def test_statefulset_pods_are_the_configured_workers_of_datacenter_a(objs, tmp_path):
    cfg = config_of(objs["dc-a"], tmp_path)
    for name, sts in by_kind(objs["dc-a"], "StatefulSet").items():
        role = sts["spec"]["template"]["metadata"]["labels"]["pdd/role"]
        pods = [f"{name}-{i}" for i in range(sts["spec"]["replicas"])]
        assert [w.id for w in cfg.workers if w.role.value == role] == pods
        svc = sts["spec"]["serviceName"]
        c = container(sts)
        for pod in pods:
            w = cfg.worker(pod)
            assert w.host == f"{pod}.{svc}.pdd.svc.cluster.local"
            assert (w.port, w.metrics_port) == (port(c, "grpc"), port(c, "metrics"))
            assert w.datacenter == "dc-a"
        headless = by_kind(objs["dc-a"], "Service")[svc]["spec"]
        assert headless["clusterIP"] == "None"
        assert headless["publishNotReadyAddresses"] is True
    assert cfg.router.host == "0.0.0.0"
    router = container(by_kind(objs["dc-a"], "Deployment")["pdd-router"])
    assert cfg.router.port == port(router, "http")


def test_main_decode_pods_match_both_datacenters_configs(objs, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg_a = config_of(objs["dc-a"], tmp_path / "a")
    cfg_b = config_of(objs["dc-b"], tmp_path / "b")
    sts = by_kind(objs["dc-b"], "StatefulSet")["pdd-main-decode"]
    pods = [f"pdd-main-decode-{i}" for i in range(sts["spec"]["replicas"])]
    assert [w.id for w in cfg_b.workers] == pods
    assert [w.id for w in cfg_a.workers if w.role.value == "main_decode"] == pods
    c = container(sts)
    for pod in pods:
        a, b = cfg_a.worker(pod), cfg_b.worker(pod)
        assert b.host == "0.0.0.0"
        assert (a.role, a.port, a.metrics_port, a.datacenter) == (
            b.role,
            b.port,
            b.metrics_port,
            b.datacenter,
        )
        assert (b.port, b.metrics_port) == (port(c, "grpc"), port(c, "metrics"))
        assert b.datacenter == "dc-b"
    assert port(c, "kv") == cfg_b.transfer.listen_port


def test_each_main_decode_pod_has_its_own_wan_load_balancer(objs, tmp_path):
    cfg = config_of(objs["dc-b"], tmp_path)
    services = by_kind(objs["dc-b"], "Service")
    for w in cfg.workers:
        svc = services[f"{w.id}-wan"]["spec"]
        assert svc["type"] == "LoadBalancer"
        assert svc["selector"]["statefulset.kubernetes.io/pod-name"] == w.id
        ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]}
        assert ports == {
            "grpc": (w.port, "grpc"),
            "kv": (cfg.transfer.listen_port, "kv"),
            "metrics": (w.metrics_port, "metrics"),
        }


def test_datacenters_share_every_setting_but_the_addresses(objs, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg_a = config_of(objs["dc-a"], tmp_path / "a")
    cfg_b = config_of(objs["dc-b"], tmp_path / "b")
    for section in ("model", "engine", "transfer", "cache"):
        assert getattr(cfg_a, section) == getattr(cfg_b, section), section
    assert cfg_a.transfer.tls is True


@pytest.mark.parametrize("dc", sorted(OVERLAYS))
def test_containers_run_real_cli_commands_with_real_flags(objs, dc, tmp_path):
    for obj in objs[dc]:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        c = container(obj)
        assert "command" not in c  # the image's entrypoint: tini -- pdd (test_docker.py)
        cmd, *rest = c["args"]
        assert cmd in COMMANDS
        flags = {a.split("=")[0] for a in rest if a.startswith("--")}
        assert flags <= cli_flags(cmd), (cmd, flags - cli_flags(cmd))
        assert rest[rest.index("--config") + 1] == "/etc/pdd/pdd.yaml"
        role = obj["spec"]["template"]["metadata"]["labels"]["pdd/role"]
        if obj["kind"] == "Deployment":
            assert (cmd, role) == ("router", "router")
            continue
        assert COMMAND_ROLE[cmd] == role
        assert rest[rest.index("--worker") + 1] == "$(POD_NAME)"
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}) for e in c["env"]}
        assert env["POD_NAME"]["fieldPath"] == "metadata.name"
        assert env["POD_IP"]["fieldPath"] == "status.podIP"
        # The pod-specific overrides load, and each pod finds its own entry with its role.
        cfg = config_of(objs[dc], tmp_path, set_overrides(rest, {"POD_IP": POD_IP}))
        assert cfg.transfer.listen_host == POD_IP
        for i in range(obj["spec"]["replicas"]):
            assert cfg.worker(f"{obj['metadata']['name']}-{i}").role.value == role


def test_router_probes_health_for_readiness_and_metrics_for_liveness(objs):
    c = container(by_kind(objs["dc-a"], "Deployment")["pdd-router"])
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}


@pytest.mark.parametrize("dc", sorted(OVERLAYS))
def test_worker_probes_use_metrics_port_and_grpc_health(objs, dc):
    for sts in by_kind(objs[dc], "StatefulSet").values():
        c = container(sts)
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        grpc_port = str(port(c, "grpc"))
        assert c["livenessProbe"]["exec"]["command"] == ["pdd-healthcheck", "--port", grpc_port]
        # Engines load for minutes: the start-up probe allows 20 of them.
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] == 1200


@pytest.mark.parametrize("dc", sorted(OVERLAYS))
def test_selectors_select_their_own_pods(objs, dc):
    templates = {}
    for obj in objs[dc]:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()
            templates[obj["metadata"]["name"]] = labels
    for name, svc in by_kind(objs[dc], "Service").items():
        sel = dict(svc["spec"]["selector"])
        pod = sel.pop("statefulset.kubernetes.io/pod-name", None)
        hits = [n for n, labels in templates.items() if sel.items() <= labels.items()]
        assert len(hits) == 1, (name, hits)
        if pod is not None:
            assert pod.rsplit("-", 1)[0] == hits[0]


def test_gpus_come_from_the_overlays_not_the_base(objs):
    for role in ("prefill", "relay-decode", "main-decode"):
        (sts,) = [o for o in render(K8S / "base" / role) if o["kind"] == "StatefulSet"]
        assert "nvidia.com/gpu" not in container(sts)["resources"]["limits"]
    for dc in OVERLAYS:
        for sts in by_kind(objs[dc], "StatefulSet").values():
            assert container(sts)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    router = container(by_kind(objs["dc-a"], "Deployment")["pdd-router"])
    assert "nvidia.com/gpu" not in router["resources"]["limits"]


def test_main_decode_shared_memory_holds_the_drc_host_tier(objs, tmp_path):
    cfg = config_of(objs["dc-b"], tmp_path)
    sts = by_kind(objs["dc-b"], "StatefulSet")["pdd-main-decode"]
    (shm,) = [v for v in pod_spec(sts)["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    shm_gib = gib(shm["emptyDir"]["sizeLimit"])
    assert shm_gib > cfg.cache.host_capacity_gib
    assert gib(container(sts)["resources"]["limits"]["memory"]) > shm_gib


@pytest.mark.parametrize("dc", sorted(OVERLAYS))
def test_files_the_config_names_are_mounted(objs, dc, tmp_path):
    cfg = config_of(objs[dc], tmp_path)
    for obj in objs[dc]:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        volumes = {v["name"]: v for v in pod_spec(obj)["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container(obj)["volumeMounts"]}
        assert mounts["/etc/pdd"]["configMap"]["name"] == "pdd-config"
        assert str(cfg.model.path).startswith("/models/")
        assert mounts["/models"]["persistentVolumeClaim"]["claimName"] == "pdd-models"
        if obj["kind"] == "StatefulSet":
            t = cfg.transfer
            for path in (t.tls_cert_file, t.tls_key_file, t.tls_ca_file):
                directory, _, key = path.rpartition("/")
                assert mounts[directory]["secret"]["secretName"] == "pdd-wan-tls", path
                assert key in ("tls.crt", "tls.key", "ca.crt")


@pytest.mark.parametrize("dc", sorted(OVERLAYS))
def test_scrape_annotations_name_the_metrics_port(objs, dc):
    for obj in objs[dc]:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        notes = obj["spec"]["template"]["metadata"]["annotations"]
        name = "http" if obj["kind"] == "Deployment" else "metrics"
        assert int(notes["prometheus.io/port"]) == port(container(obj), name)
        assert notes["prometheus.io/path"] == "/metrics"
