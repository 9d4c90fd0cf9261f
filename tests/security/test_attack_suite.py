"""The attack suite against a real PDD topology (router + P + RLD + MD, real vLLM) with every
credential on, made by `pdd certs`: API keys (an admin key and limited client keys), the
worker token, mutual TLS on router -> worker gRPC and on P -> MD KV, the challenge on UCX.

- every worker RPC without the token, with a wrong one, without TLS, or without a client
  certificate of the fleet's CA is refused;
- a forged KV connection to MD's KV port (no TLS, another CA's certificate, the fleet's
  certificate but no proof of the token) is closed and MD's reservation receives nothing;
- a non-admin key gets 403 on /debug/* and on `pdd` overrides; a key over its limit 429;
- a second tenant's identical prompt finds nothing cached (MD's DRC, P's prefix cache) while
  the first tenant's own next turn hits;
- both PDD pipelines still serve with everything on, and no secret reaches logs, metrics or
  /debug/config.
One topology for the module (started once, stopped at the end)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from pathlib import Path

import grpc
import httpx
import pytest

from pdd.certs import main as certs_main
from pdd.errors import TransferError
from pdd.proto import worker_pb2 as pb
from pdd.proto import worker_pb2_grpc as pb_grpc
from pdd.transfer.tcp_io import FrameReader, send_all
from pdd.transfer.wire import FrameKind, pack_auth, pack_hello
from tests.helpers import serve, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "SmolLM2-135M-Instruct"
ADMIN = "sk-pdd-attack-admin-000000000001"
CLIENT = "sk-pdd-attack-client-00000000002"
OTHER = "sk-pdd-attack-other-000000000003"
GAMMA = "sk-pdd-attack-gamma-000000000004"
WORKERS = ["p", "rld", "md"]
PROMPT_IDS = list(range(1000, 1200))  # 200 tokens: 6 whole blocks of 32


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attack")
    creds, rogue = tmp / "creds", tmp / "rogue"
    assert certs_main(["--out", str(creds), "--name", "node=127.0.0.1"]) == 0
    assert certs_main(["--out", str(rogue), "--name", "node=127.0.0.1"]) == 0  # another CA
    keys = f"{ADMIN}\n{CLIENT} tenant=acme rpm=2\n{OTHER} tenant=beta\n{GAMMA} tenant=gamma\n"
    (tmp / "keys").write_text(keys)
    node = creds / "node"
    sets = [f"router.api_keys_file={tmp / 'keys'}",
            f"security.worker_token_file={creds / 'worker-token'}",
            "security.grpc_tls.enabled=true", f"security.grpc_tls.cert_file={node / 'tls.crt'}",
            f"security.grpc_tls.key_file={node / 'tls.key'}",
            f"security.grpc_tls.ca_file={node / 'ca.crt'}",
            "transfer.tls=true", f"transfer.tls_cert_file={node / 'tls.crt'}",
            f"transfer.tls_key_file={node / 'tls.key'}", f"transfer.tls_ca_file={node / 'ca.crt'}",
            "engine.kv_cache_space_gib=0.25",
            *[f"workers.{i}.engine.kv_cache_space_gib=0.25" for i in range(3)]]  # fmt: skip
    s = serve("configs/local.yaml", WORKERS, sets, pin_metrics_ports=True)
    try:
        yield {"served": s, "creds": creds, "rogue": rogue}
    finally:
        stop(s)


def _token(fleet) -> str:
    return (fleet["creds"] / "worker-token").read_text().strip()


def _channel(fleet, worker: str, folder: Path | None, client_cert: bool = True):
    target = f"127.0.0.1:{fleet['served'].worker_ports[worker]}"
    if folder is None:
        return grpc.aio.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(
        root_certificates=(fleet["creds"] / "node/ca.crt").read_bytes(),
        private_key=(folder / "node/tls.key").read_bytes() if client_cert else None,
        certificate_chain=(folder / "node/tls.crt").read_bytes() if client_cert else None,
    )
    return grpc.aio.secure_channel(target, creds)


CALLS = {
    "Health": pb.HealthRequest(),
    "Stats": pb.StatsRequest(),
    "Abort": pb.AbortRequest(),
    "SendKv": pb.SendKvRequest(kv_request_id="x"),
    "PrepareKv": pb.PrepareKvRequest(kv_request_id="x", prompt_token_ids=PROMPT_IDS),
    "AwaitKv": pb.AwaitKvRequest(kv_request_id="x"),
    "CancelKv": pb.CancelKvRequest(kv_request_id="x"),
    "DrcEvents": pb.DrcEventsRequest(),
}


async def _call_all(channel, metadata) -> dict[str, grpc.StatusCode]:
    """The status of every worker RPC made on ``channel`` with ``metadata``."""
    stub = pb_grpc.WorkerStub(channel)
    out = {}
    for name, msg in CALLS.items():
        try:
            await getattr(stub, name)(msg, timeout=10, metadata=metadata)
            out[name] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            out[name] = exc.code()
    try:
        async for _ in stub.Generate(pb.GenerateRequest(), timeout=10, metadata=metadata):
            pass
        out["Generate"] = grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        out["Generate"] = exc.code()
    return out


@pytest.mark.parametrize("worker", WORKERS)
def test_every_worker_rpc_refuses_a_missing_wrong_or_untrusted_credential(fleet, worker):
    token = _token(fleet)
    cases = {  # name -> (certificate folder, client cert, token), expected code
        "no token": ((fleet["creds"], True, None), grpc.StatusCode.UNAUTHENTICATED),
        "wrong token": ((fleet["creds"], True, "wk-guessed-0000000000000000"),
                        grpc.StatusCode.UNAUTHENTICATED),
        "plaintext + token": ((None, True, token), grpc.StatusCode.UNAVAILABLE),
        "no client certificate": ((fleet["creds"], False, token), grpc.StatusCode.UNAVAILABLE),
        "another CA + token": ((fleet["rogue"], True, token), grpc.StatusCode.UNAVAILABLE),
    }  # fmt: skip

    async def go():
        results = {}
        for name, ((folder, cert, tok), _) in cases.items():
            metadata = () if tok is None else (("authorization", f"Bearer {tok}"),)
            async with _channel(fleet, worker, folder, cert) as ch:
                results[name] = await _call_all(ch, metadata)
        return results

    results = asyncio.run(go())
    for name, (_, expected) in cases.items():
        assert set(results[name].values()) == {expected}, (name, results[name])


async def _md(fleet, name: str, msg):  # type: ignore[no-untyped-def]
    async with _channel(fleet, "md", fleet["creds"]) as ch:
        meta = (("authorization", f"Bearer {_token(fleet)}"),)
        return await getattr(pb_grpc.WorkerStub(ch), name)(msg, timeout=10, metadata=meta)


def _forge(address, how: str, fleet) -> bool:
    """One forged KV sender on MD's KV port; True when MD closed it before any chunk."""
    raw = socket.create_connection((address.host, address.port), timeout=10)
    try:
        if how == "plaintext":  # a DATA-looking frame without TLS
            raw.sendall(b"PDDK" + bytes(200))
            return _closed(raw)
        ctx = ssl.create_default_context(cafile=str(fleet["creds"] / "node/ca.crt"))
        ctx.check_hostname = False
        folder = fleet["rogue"] if how == "another CA" else fleet["creds"]
        ctx.load_cert_chain(folder / "node/tls.crt", folder / "node/tls.key")
        sock = ctx.wrap_socket(raw)
        reader = FrameReader(sock)
        kind, _ = reader.read_frame()
        assert kind is FrameKind.CHALLENGE
        send_all(sock, [pack_hello(7, 0, 1), pack_auth(bytes(32))])  # no proof of the token
        return _closed(sock)
    except (OSError, TransferError):  # ssl.SSLError is an OSError
        return True  # refused in the TLS handshake (or right after it)
    finally:
        raw.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closes ``sock`` within its timeout (a TLS alert may come first)."""
    try:
        for _ in range(64):
            if sock.recv(1024) == b"":
                return True
    except OSError:
        return True  # reset, or a TLS error: closed too
    return False


def test_a_forged_kv_sender_is_refused_and_the_drc_is_unchanged(fleet):
    prep = asyncio.run(_md(fleet, "PrepareKv", pb.PrepareKvRequest(
        kv_request_id="forge-1", prompt_token_ids=PROMPT_IDS, lease_s=30)))  # fmt: skip
    assert prep.reserved_blocks == 6 and prep.address.transport == "tcp"
    assert len(prep.landing_key) == 12  # only the P the router picks learns it (SendKv)
    for how in ("plaintext", "another CA", "no proof"):
        assert _forge(prep.address, how, fleet), how
    waited = asyncio.run(_md(fleet, "AwaitKv", pb.AwaitKvRequest(kv_request_id="forge-1",
                                                                 timeout_s=0.5)))  # fmt: skip
    assert waited.bytes_received == 0 and waited.state != "done"
    asyncio.run(_md(fleet, "CancelKv", pb.CancelKvRequest(kv_request_id="forge-1")))
    again = asyncio.run(_md(fleet, "PrepareKv", pb.PrepareKvRequest(
        kv_request_id="forge-2", prompt_token_ids=PROMPT_IDS, lease_s=30)))  # fmt: skip
    assert again.cached_blocks == 0  # nothing landed in the DRC under the prompt's hashes
    asyncio.run(_md(fleet, "CancelKv", pb.CancelKvRequest(kv_request_id="forge-2")))


def _post(fleet, key: str, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, **body}  # fmt: skip
    url = fleet["served"].url + "/completions"
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


@pytest.mark.parametrize("pipeline", ["p_rld_md", "p_md"])
def test_both_pipelines_serve_with_every_credential_on(fleet, pipeline):
    long_prompt = "Tell me about the history of Paris. " * 40  # whole blocks cross both links
    r = _post(fleet, ADMIN, prompt=long_prompt, pdd={"pipeline": pipeline})
    assert r.status_code == 200, r.text
    record = r.json()["pdd"]
    assert record["pipeline"] == pipeline and r.json()["usage"]["completion_tokens"] == 4


def test_non_admin_keys_get_403_and_a_key_over_its_limit_429(fleet):
    root = fleet["served"].url.removesuffix("/v1")
    r = httpx.get(root + "/debug/workers", headers={"Authorization": f"Bearer {OTHER}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = _post(fleet, OTHER, pdd={"pipeline": "p_rld_md"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert [_post(fleet, CLIENT).status_code for _ in range(2)] == [200, 200]
    over = _post(fleet, CLIENT)
    assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
    assert over.json()["error"]["code"] == "rate_limit_exceeded"
    assert _post(fleet, OTHER).status_code == 200  # another key: unaffected


def test_a_tenant_never_hits_another_tenants_cached_prefix(fleet):
    """beta's prompt lands in MD's DRC and P's prefix cache; beta's repeat hits them, gamma's
    identical prompt finds nothing (the router's DRC view reports 0, P's prefix cache gives 0,
    MD reserves every block again: the same WAN bytes as beta's cold turn), and gamma's own
    repeat hits."""
    prompt = "A document only beta has read: " + "the tide tables of Saint-Malo, " * 40

    def turn(key: str) -> tuple[int, int, int]:  # md_cached_tokens, cached_tokens, WAN bytes
        r = _post(fleet, key, prompt=prompt)
        assert r.status_code == 200, r.text
        out = r.json()
        usage = out["usage"]["prompt_tokens_details"]
        return out["pdd"]["md_cached_tokens"], usage["cached_tokens"], out["pdd"]["wan_kv_bytes"]

    def repeat(key: str) -> tuple[int, int, int]:  # the DRC view follows MD within a poll or two
        deadline = time.monotonic() + 30
        while True:
            got = turn(key)
            if got[0] > 0 or time.monotonic() > deadline:
                return got
            time.sleep(1.0)

    md, cached, cold_wan = turn(OTHER)
    assert (md, cached) == (0, 0) and cold_wan > 0
    md, cached, _ = repeat(OTHER)
    assert md >= 320 and cached > 0, (md, cached)  # beta's own second turn
    assert turn(GAMMA) == (0, 0, cold_wan)  # the same prompt, another tenant: nothing of beta's
    md, cached, _ = repeat(GAMMA)
    assert md >= 320 and cached > 0, (md, cached)


def test_no_secret_in_logs_metrics_or_debug_config(fleet):
    s = fleet["served"]
    root = s.url.removesuffix("/v1")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    texts = {
        "router /metrics": httpx.get(root + "/metrics", timeout=5).text,
        "/debug/config": httpx.get(root + "/debug/config", headers=admin, timeout=5).text,
        "logs": "\n".join(s.output),
        **{f"{w} /metrics": httpx.get(f"http://127.0.0.1:{s.metrics_ports[w]}/metrics",
                                      timeout=5).text for w in WORKERS},
    }  # fmt: skip
    key_pem = (fleet["creds"] / "node/tls.key").read_text().splitlines()[1]
    secrets = [ADMIN, CLIENT, OTHER, GAMMA, _token(fleet), key_pem]
    for where, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"a secret leaked into {where}"
    assert "refused" in texts["logs"]  # the attacks above were logged, without secrets
