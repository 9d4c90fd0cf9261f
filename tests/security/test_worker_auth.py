"""Router <-> worker authentication over real gRPC (a fake worker servicer, no engine): the
worker token checked by pdd.worker.auth, sent by pdd.router.fleet.worker_auth, and (mutual) TLS."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

import grpc
import pytest

from pdd.config import PddConfig, RouterConfig, WorkerConfig
from pdd.config.security import GrpcTlsConfig, SecurityConfig
from pdd.errors import ConfigError, PddError, UnavailableError, WorkerError
from pdd.proto import worker_pb2, worker_pb2_grpc
from pdd.router.fleet.worker_auth import WorkerCredentials
from pdd.router.fleet.workers import WorkerClient
from pdd.worker.auth import TokenAuthInterceptor, server_credentials
from tests.router.fake_worker import FakeWorker

pytestmark = pytest.mark.timeout(60)
TOKEN = "wk-test-0123456789abcdef-token"
OTHER = "wk-test-fedcba9876543210-other"


def token_file(tmp_path: Path, value: str, name: str = "token") -> str:
    path = tmp_path / name
    path.write_text(value + "\n")
    return str(path)


async def serve_fake(token: bytes | None, tls: GrpcTlsConfig | None = None):
    """A fake worker behind the real interceptor (and TLS); returns (server, port, auth)."""
    auth = TokenAuthInterceptor(token) if token is not None else None
    server = grpc.aio.server(interceptors=[auth] if auth else [])
    worker_pb2_grpc.add_WorkerServicer_to_server(FakeWorker("w0"), server)
    creds = server_credentials(tls) if tls is not None else None
    port = (
        server.add_secure_port("127.0.0.1:0", creds)
        if creds
        else server.add_insecure_port("127.0.0.1:0")
    )
    await server.start()
    return server, port, auth


def client(port: int, security: SecurityConfig) -> WorkerClient:
    worker = WorkerConfig(id="w0", role="colocated", port=port)
    return WorkerClient(
        worker, RouterConfig(worker_rpc_timeout_s=5), WorkerCredentials.from_config(security)
    )


async def health_with(port: int, security: SecurityConfig):
    c = client(port, security)
    try:
        return await c.health()
    finally:
        await c.close()


def test_a_call_with_the_token_is_served(tmp_path):
    async def go():
        server, port, auth = await serve_fake(TOKEN.encode())
        try:
            sec = SecurityConfig(worker_token_file=token_file(tmp_path, TOKEN))
            h = await health_with(port, sec)
            c = client(port, sec)
            stream_ok = await _generate_first(c)
            await c.close()
            return h, stream_ok, auth.refused
        finally:
            await server.stop(None)

    health, stream_ok, refused = asyncio.run(go())
    assert (health.ready, health.worker_id) == (True, "w0")
    assert stream_ok  # the server-streaming Generate carries the token too
    assert refused == 0


async def _generate_first(c: WorkerClient) -> bool:
    """One Generate through the raw stub of the client's channel (any reply proves the call
    passed the interceptor)."""
    stub = c._stub  # the authenticated stub the router uses
    req = worker_pb2.GenerateRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=worker_pb2.SamplingParams(max_tokens=1),
    )
    replies = [r async for r in stub.Generate(req, timeout=5)]
    return bool(replies) and replies[-1].finish_reason != ""


@pytest.mark.parametrize("presented", ["none", "wrong"])
def test_a_call_without_the_token_is_unauthenticated_and_logged_without_secrets(
    tmp_path, caplog, presented
):
    async def go():
        server, port, auth = await serve_fake(TOKEN.encode())
        try:
            value = None if presented == "none" else token_file(tmp_path, OTHER)
            with pytest.raises(WorkerError) as err:
                await health_with(port, SecurityConfig(worker_token_file=value))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                md = () if presented == "none" else (("authorization", f"Bearer {OTHER}"),)
                with pytest.raises(grpc.aio.AioRpcError) as raw:
                    req = worker_pb2.GenerateRequest(request_id="x", prompt_token_ids=[1])
                    async for _ in stub.Generate(req, timeout=5, metadata=md):
                        pass
            return err.value, raw.value, auth.refused
        finally:
            await server.stop(None)

    with caplog.at_level(logging.WARNING, logger="pdd.worker.auth"):
        err, raw, refused = asyncio.run(go())
    assert raw.code() is grpc.StatusCode.UNAUTHENTICATED
    assert refused == 2
    expected = "no worker credential" if presented == "none" else "wrong worker credential"
    assert err.code == "worker_auth"
    assert err.message.startswith(f"worker w0 refused the router's credential ({expected}: ")
    assert [r.getMessage() for r in caplog.records] == [
        f"refused /pdd.worker.v1.Worker/Health: {expected}"
    ]  # the second refusal is within LOG_EVERY_S: counted, not logged
    assert TOKEN not in caplog.text and OTHER not in caplog.text
    assert TOKEN not in err.message and OTHER not in err.message


def test_token_file_validation(tmp_path):
    assert SecurityConfig().worker_token() is None
    assert SecurityConfig(worker_token_file=token_file(tmp_path, TOKEN)).worker_token() == (
        TOKEN.encode()
    )
    for bad in ("short", "has a space in the token 123", ""):
        with pytest.raises(ConfigError, match="at least 16 printable"):
            SecurityConfig(worker_token_file=token_file(tmp_path, bad)).worker_token()
    with pytest.raises(ConfigError, match="cannot read"):
        SecurityConfig(worker_token_file=str(tmp_path / "missing")).worker_token()
    with pytest.raises(ConfigError, match="resolved by `pdd serve`"):
        SecurityConfig(worker_token_file="auto").worker_token()
    with pytest.raises(ValueError, match="needs cert_file"):
        PddConfig.model_validate({"security": {"grpc_tls": {"enabled": True}}})
    assert repr(WorkerCredentials(token=b"x" * 20)) == "WorkerCredentials(token=set, tls=False)"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl command line tool not installed")
    from pdd.transfer.testing import make_pki

    return make_pki(str(tmp_path_factory.mktemp("pki")))


def tls_cfg(pki: dict, name: str, ca: str = "ca.pem", **kw) -> GrpcTlsConfig:
    return GrpcTlsConfig(
        enabled=True,
        cert_file=pki[f"{name}.pem"],
        key_file=pki[f"{name}.key"],
        ca_file=pki[ca],
        server_name="receiver",  # make_pki's server certificate has CN=receiver, no SAN
        **kw,
    )


@pytest.mark.parametrize(
    ("who", "served"),
    [("sender", True), ("rogue", False), ("plaintext", False)],
)
def test_mutual_tls_admits_only_clients_of_the_ca(tmp_path, pki, who, served):
    async def go():
        server, port, _ = await serve_fake(TOKEN.encode(), tls_cfg(pki, "receiver"))
        try:
            tok = token_file(tmp_path, TOKEN)
            if who == "plaintext":
                sec = SecurityConfig(worker_token_file=tok)
            else:
                sec = SecurityConfig(worker_token_file=tok, grpc_tls=tls_cfg(pki, who))
            try:
                return (await health_with(port, sec)).ready
            except PddError as exc:
                return exc
        finally:
            await server.stop(None)

    result = asyncio.run(go())
    if served:
        assert result is True
    else:
        assert isinstance(result, UnavailableError), result  # handshake refused


def test_pdd_serve_resolves_auto_to_a_fresh_private_token_file(tmp_path):
    from pdd.launch.children import auto_token_overrides, child_specs

    cfg = PddConfig.model_validate(
        {"workers": [{"id": "w0", "role": "colocated"}], "security": {"worker_token_file": "auto"}}
    )
    config_path = tmp_path / "effective-config.yaml"
    specs = child_specs(cfg, config_path, "dc-a", python="/py")
    path = tmp_path / "worker-token"
    override = ("--set", f"security.worker_token_file={path}")
    assert all(s.argv[5:7] == override for s in specs) and len(specs) == 2
    assert path.stat().st_mode & 0o777 == 0o600
    token = SecurityConfig(worker_token_file=str(path)).worker_token()
    assert token is not None and len(token) >= 40
    assert auto_token_overrides(cfg, tmp_path) == override  # the same file for the whole run
    assert path.read_bytes().strip() == token
    plain = cfg.model_copy(update={"security": SecurityConfig()})
    assert auto_token_overrides(plain, tmp_path / "x") == ()
