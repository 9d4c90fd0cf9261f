"""Secure by default: `pdd certs` makes working credentials, a process that listens beyond
loopback without them refuses to start (unless security.insecure), every shipped config and
manifest carries them, and `pdd serve` keeps loopback topologies zero-config."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdd.certs import main as certs_main
from pdd.config import PddConfig, load_config
from pdd.config.exposure import check_router, check_worker, is_loopback, router_missing
from pdd.config.security import GrpcTlsConfig, SecurityConfig
from pdd.errors import ConfigError, PddError, UnavailableError
from pdd.launch.credentials import with_run_credentials
from tests.security.test_worker_auth import TOKEN, health_with, serve_fake

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
DEPLOYED = [REPO / "deploy/systemd/pdd.yaml", *sorted((REPO / "deploy/k8s/overlays").glob("*/pdd.yaml"))]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fleet") / "creds"
    assert certs_main(["--out", str(out), "--config", str(REPO / "configs/local.yaml"),
                       "--name", "rogue-free=10.0.0.9"]) == 0  # fmt: skip
    return out


def test_certs_writes_a_ca_a_certificate_per_process_and_private_secrets(fleet):
    assert {p.name for p in fleet.iterdir()} >= {"ca.crt", "ca.key", "worker-token", "api-keys",
                                                  "router", "p", "rld", "md", "rogue-free"}  # fmt: skip
    for secret in ("ca.key", "worker-token", "api-keys", "p/tls.key"):
        assert (fleet / secret).stat().st_mode & 0o777 == 0o600, secret
    assert SecurityConfig(worker_token_file=str(fleet / "worker-token")).worker_token()
    line = [ln for ln in (fleet / "api-keys").read_text().splitlines() if ln[:1] != "#"]
    assert len(line) == 1 and line[0].startswith("sk-pdd-") and " admin" in line[0]
    ca = (fleet / "ca.crt").read_bytes()
    token = (fleet / "worker-token").read_bytes()
    assert certs_main(["--out", str(fleet), "--name", "late=10.0.0.8"]) == 0  # same CA, same token
    assert (fleet / "ca.crt").read_bytes() == ca == (fleet / "late/ca.crt").read_bytes()
    assert (fleet / "worker-token").read_bytes() == token


def _tls(folder: Path) -> GrpcTlsConfig:
    return GrpcTlsConfig(enabled=True, cert_file=str(folder / "tls.crt"),
                         key_file=str(folder / "tls.key"), ca_file=str(folder / "ca.crt"))  # fmt: skip


def test_certs_of_one_fleet_speak_mutual_tls_and_another_fleets_do_not(fleet, tmp_path):
    assert certs_main(["--out", str(tmp_path / "other"), "--name", "router=127.0.0.1"]) == 0

    async def go(client_folder: Path):
        server, port, _ = await serve_fake(TOKEN.encode(), _tls(fleet / "md"))
        (tmp_path / "t").write_text(TOKEN)
        sec = SecurityConfig(worker_token_file=str(tmp_path / "t"), grpc_tls=_tls(client_folder))
        try:
            return (await health_with(port, sec)).ready  # dials 127.0.0.1: a SAN of every cert
        except PddError as exc:
            return exc
        finally:
            await server.stop(None)

    assert asyncio.run(go(fleet / "router")) is True
    assert isinstance(asyncio.run(go(tmp_path / "other/router")), UnavailableError)


def test_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.9.0.1", "::1", "localhost", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.77.0.1", "md0.example.net", "auto"]))


def _exposed(**security) -> PddConfig:
    return PddConfig.model_validate({
        "router": {"host": "0.0.0.0"},
        "workers": [{"id": "p", "role": "prefill", "host": "10.0.0.1"},
                    {"id": "md", "role": "main_decode", "host": "10.0.0.2"}],
        "security": security,
    })  # fmt: skip


def test_an_exposed_router_without_credentials_refuses_naming_each_one():
    with pytest.raises(ConfigError) as err:
        check_router(_exposed(), {})
    for named in ("API keys", "PDD_API_KEY", "worker token", "gRPC TLS", "pdd certs"):
        assert named in err.value.message
    assert router_missing(_exposed(), {"PDD_API_KEY": "sk-x"}) == [
        "the worker token (security.worker_token_file)", "gRPC TLS (security.grpc_tls)"]  # fmt: skip


def test_an_exposed_worker_without_credentials_refuses():
    cfg = _exposed()
    with pytest.raises(ConfigError, match="worker md .*worker token.*gRPC TLS.*KV TLS"):
        check_worker(cfg, cfg.worker("md"))


def test_insecure_starts_and_reports_what_is_missing(caplog):
    cfg = _exposed(insecure=True)
    missing = check_worker(cfg, cfg.worker("p"))
    assert missing == ["the worker token (security.worker_token_file)",
                       "gRPC TLS (security.grpc_tls)", "KV TLS (transfer.tls)"]  # fmt: skip
    assert "security.insecure: worker p" in caplog.text and "WITHOUT" in caplog.text


@pytest.mark.parametrize("path", CONFIGS + DEPLOYED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_starts_every_process(path, tmp_path):
    """configs/ (loopback, or the lab with pdd serve's run credentials) and the deploy fleets
    (their credential files) pass the start check of each of their processes as written."""
    cfg = load_config(path)
    if cfg.security.auto_credentials:  # the lab: as `pdd serve` writes it, at lab addresses
        data = cfg.model_dump(mode="json")
        for i, w in enumerate(data["workers"]):
            w["host"] = f"10.77.0.{i + 1}"
        cfg = PddConfig.model_validate(with_run_credentials(data, tmp_path))
        assert cfg.security.grpc_tls.enabled and cfg.transfer.tls
        assert cfg.security.worker_token() is not None
        assert [m.split()[0] for m in router_missing(cfg, {})] == ["API"]  # only the client API
    else:
        assert not cfg.security.insecure, "only the lab's router API may run open"
    check_router(cfg, {})
    for w in cfg.workers:
        check_worker(cfg, w)


@pytest.mark.parametrize("path", DEPLOYED, ids=lambda p: str(p.relative_to(REPO)))
def test_deployed_fleets_turn_every_credential_on(path):
    cfg = load_config(path)
    if "dc-b" not in str(path):  # datacenter B runs MainDecode only, no router
        assert cfg.router.api_keys_file is not None
    assert cfg.security.worker_token_file and cfg.security.grpc_tls.enabled
    assert cfg.security.grpc_tls.mutual and cfg.transfer.tls and not cfg.security.insecure


def test_env_example_names_the_variable_the_router_reads():
    text = (REPO / "deploy/systemd/pdd.env.example").read_text()
    assert "PDD_API_KEY=" in text and "PDD_API_KEYS" not in text and "lanned" not in text
    router = yaml.safe_load_all((REPO / "deploy/k8s/base/router/router.yaml").read_text())
    assert (
        "when the router supports" not in (REPO / "deploy/k8s/base/router/router.yaml").read_text()
    )
    assert next(router)["kind"] == "Deployment"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["pdd.router.main", "--set", "router.host=0.0.0.0"], "API keys"),
        (["pdd.launch.worker", "--worker", "md", "--set", "workers.2.host=0.0.0.0"], "KV TLS"),
    ],
)
def test_a_process_bound_beyond_loopback_without_credentials_exits_2(argv, named):
    """Real entry points, before any engine or tokenizer loads: exit 2 and say why."""
    cmd = [sys.executable, "-m", argv[0], "--config", str(REPO / "configs/local.yaml"), *argv[1:]]
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert "refusing to start" in r.stderr and named in r.stderr and "pdd certs" in r.stderr


def test_an_insecure_router_starts_warns_and_says_so_in_health():
    """A real `pdd router` on 0.0.0.0 without keys but with security.insecure (no workers up)."""
    import os
    import signal

    import httpx

    from pdd.launch import free_port
    from tests.helpers import wait_until

    port = free_port()
    cmd = [sys.executable, "-m", "pdd.router.main", "--config", str(REPO / "configs/colocated.yaml"),
           "--set", "router.host=0.0.0.0", "--set", f"router.port={port}",
           "--set", "security.insecure=true"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PDD_API_KEY", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:

        def health():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.HTTPError:
                return None

        r = wait_until(health, 60, "the router's /health")
        assert r.json()["insecure"] == ["API keys (router.api_keys_file or $PDD_API_KEY)"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "security.insecure: the router" in err and "WITHOUT API keys" in err


def test_a_lab_placement_runs_host_private():
    """`pdd serve` in the lab: every address is a veth of this host, so a config without
    credentials runs (warned, listed in /health) instead of refusing."""
    from pdd.launch.credentials import host_private
    from pdd.launch.placement import Placed

    placed = host_private(Placed(_exposed(), "dc-a", "http://10.0.0.6:8000/v1"))
    assert placed.cfg.security.insecure and placed.url == "http://10.0.0.6:8000/v1"
    assert check_router(placed.cfg, {}) != []  # warned about, not refused
