"""Workers joining by registration: the real router (API keys on) and the real registration
client of pdd.worker.register, against fake gRPC workers. A registered worker is admitted,
polled and routed to; it is removed when its heartbeats stop and re-admitted by the next
one; a worker that stops deregisters at once; ids of configured workers cannot be taken; a
registration without the fleet's worker token is refused even with an API key."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest

from pdd.config import WorkerConfig
from pdd.kv_geometry import folder_geometry
from pdd.registration import REGISTRATION_PATH, WORKER_TOKEN_HEADER
from pdd.router.status import format_status
from pdd.worker.register import RegistrationClient, registration_for
from tests.helpers import wait_until
from tests.router.fake_worker import FakeWorker, start_fake_worker
from tests.router.harness import RouterHarness

KEY = "fleet-secret-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
WORKER_TOKEN = b"worker-token-0123456789abcdef"
FLEET = {**AUTH, WORKER_TOKEN_HEADER: WORKER_TOKEN.decode()}  # what a registering worker sends
MODEL = "SmolLM2-135M-Instruct"


class Loop:
    """An event loop in a thread: hosts the extra fake worker and the registration clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 10.0):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def fleet(codec, tmp_path_factory) -> Iterator[tuple[RouterHarness, FakeWorker, int, Loop]]:
    secrets = tmp_path_factory.mktemp("keys")
    keys, token = secrets / "keys", secrets / "worker-token"
    keys.write_text(KEY + "\n")
    token.write_bytes(WORKER_TOKEN + b"\n")
    h = RouterHarness(codec, api_keys_file=str(keys), security={"worker_token_file": str(token)},
                      fleet={"accept_registrations": True, "heartbeat_timeout_s": 0.5})  # fmt: skip
    loop = Loop()
    joiner = FakeWorker("w1", 512)
    server, port = loop.run(start_fake_worker(joiner))
    h._thread.start()  # not h.start(): its readiness poll has no API key
    assert h._ready.wait(30) and h._error is None
    h.wait_health(200)
    try:
        yield h, joiner, port, loop
    finally:
        h.stop()
        loop.run(server.stop(None))
        loop.close()


def workers(h: RouterHarness) -> dict[str, dict]:
    got = httpx.get(h.root + "/debug/workers", headers=AUTH, timeout=2).json()["workers"]
    return {w["id"]: w for w in got}


def client_for(port: int, h: RouterHarness, interval_s: float = 0.1) -> RegistrationClient:
    cfg = WorkerConfig(id="w1", role="colocated", host="127.0.0.1", datacenter="dc-a")
    return RegistrationClient(h.url, registration_for(cfg, port, 0, 8), interval_s, WORKER_TOKEN)


def test_registration_needs_an_api_key(fleet, monkeypatch):
    h, _, port, loop = fleet
    monkeypatch.delenv("PDD_API_KEY", raising=False)
    body = {"id": "w1", "role": "colocated", "host": "127.0.0.1", "port": port}
    r = httpx.post(h.root + REGISTRATION_PATH, json=body, timeout=2)
    assert r.status_code == 401
    client = client_for(port, h)
    assert loop.run(client.beat()) is False and "w1" not in workers(h)
    loop.run(client._http.aclose())


def test_registration_needs_the_worker_token(fleet, monkeypatch):
    h, _, port, loop = fleet
    body = {"id": "w1", "role": "colocated", "host": "127.0.0.1", "port": port}
    for token in (None, "worker-token-WRONG-0123456789"):
        headers = dict(AUTH, **({WORKER_TOKEN_HEADER: token} if token else {}))
        r = httpx.post(h.root + REGISTRATION_PATH, json=body, headers=headers, timeout=2)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_worker_token"
    monkeypatch.setenv("PDD_API_KEY", KEY)
    cfg = WorkerConfig(id="w1", role="colocated", host="127.0.0.1", datacenter="dc-a")
    tokenless = RegistrationClient(h.url, registration_for(cfg, port, 0, 8), 0.1)
    assert loop.run(tokenless.beat()) is False and "w1" not in workers(h)
    loop.run(tokenless._http.aclose())


def test_a_registered_worker_serves_leaves_without_heartbeats_and_comes_back(fleet, monkeypatch):
    h, joiner, port, loop = fleet
    monkeypatch.setenv("PDD_API_KEY", KEY)
    client = client_for(port, h)
    loop.run(client.start())
    w1 = wait_until(lambda: workers(h).get("w1", {}).get("healthy") and workers(h)["w1"], 5,
                    "w1 admitted and healthy")  # fmt: skip
    assert (w1["role"], w1["source"], w1["target"]) == ("colocated", "registered",
                                                       f"127.0.0.1:{port}")  # fmt: skip
    h.fake.ready = False  # the configured worker goes unready: only w1 can serve
    wait_until(lambda: not workers(h)["w0"]["healthy"], 5, "w0 unhealthy")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    r = httpx.post(h.url + "/completions", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200 and len(joiner.requests) == 1
    # it crashes (no DELETE): > heartbeat_timeout_s without a heartbeat removes it
    loop.run(client.stop(deregister=False))
    wait_until(lambda: "w1" not in workers(h), 5, "w1 removed after missed heartbeats")
    r = httpx.post(h.url + "/completions", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 503
    again = client_for(port, h)  # it comes back: its first heartbeat re-admits it
    loop.run(again.start())
    wait_until(lambda: workers(h).get("w1", {}).get("healthy"), 5, "w1 re-admitted")
    r = httpx.post(h.url + "/completions", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200 and len(joiner.requests) == 2
    loop.run(again.stop())
    h.fake.ready = True


def test_a_heartbeating_worker_stays_and_deregisters_when_it_stops(fleet, monkeypatch):
    h, _, port, loop = fleet
    monkeypatch.setenv("PDD_API_KEY", KEY)
    client = client_for(port, h, interval_s=0.1)
    loop.run(client.start())
    wait_until(lambda: workers(h).get("w1", {}).get("healthy"), 5, "w1 admitted and healthy")
    beats = client.beats
    wait_until(lambda: client.beats >= beats + 10, 10, "ten more heartbeats")  # > 0.5 s timeout
    assert workers(h)["w1"]["healthy"] is True  # still there: heartbeats keep it
    listed = httpx.get(h.root + REGISTRATION_PATH, headers=FLEET, timeout=2).json()
    assert [r["id"] for r in listed["registered"]] == ["w1"]
    loop.run(client.stop())
    assert "w1" not in workers(h)  # DELETE took it out at once


def test_a_configured_id_cannot_be_registered(fleet, monkeypatch):
    h, _, port, _ = fleet
    body = {"id": "w0", "role": "colocated", "host": "127.0.0.1", "port": port}
    r = httpx.post(h.root + REGISTRATION_PATH, json=body, headers=FLEET, timeout=2)
    assert r.status_code == 400 and "already in the fleet" in r.json()["error"]["message"]
    bad = {**body, "id": "x", "port": 0}
    assert httpx.post(h.root + REGISTRATION_PATH, json=bad, headers=FLEET, timeout=2).status_code \
        in (400, 422)  # fmt: skip


def test_a_worker_of_another_model_is_not_admitted(fleet, monkeypatch):
    """Its registration is refused (400 naming ``geometry``, the worker and the field) and it
    never joins; a worker of the router's own model (any dtype) joins with its geometry."""
    h, _, port, _ = fleet
    own = folder_geometry(h.cfg.model.resolved_path(), block_size=32, kv_dtype="bfloat16")
    body = {"id": "w-geo", "role": "colocated", "host": "127.0.0.1", "port": port}
    other = own.model_copy(update={"fingerprint": "0" * 32})
    r = httpx.post(h.root + REGISTRATION_PATH, headers=FLEET, timeout=2,
                   json={**body, "geometry": other.model_dump()})  # fmt: skip
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "geometry", r.text
    assert "worker w-geo not admitted: workers w-geo and router model" in err["message"]
    assert "fingerprint differs (w-geo: 00000000" in err["message"]
    assert "w-geo" not in workers(h)
    data = httpx.get(h.root + "/debug/workers", headers=AUTH, timeout=2).json()
    assert data["not_admitted"]["w-geo"] == err["message"].removeprefix("worker w-geo ")
    assert any(ln.split()[:3] == ["w-geo", "NOT", "ADMITTED"] for ln in format_status(data))
    r = httpx.post(h.root + REGISTRATION_PATH, headers=FLEET, timeout=2,
                   json={**body, "geometry": own.model_dump()})  # fmt: skip
    assert r.status_code == 200 and r.json()["status"] == "added"
    row = workers(h)["w-geo"]
    assert row["geometry"] == own.model_dump() and row["admitted"] is True
    assert "w-geo" not in httpx.get(h.root + "/debug/workers", headers=AUTH,
                                    timeout=2).json()["not_admitted"]  # fmt: skip
    httpx.delete(f"{h.root}{REGISTRATION_PATH}/w-geo", headers=FLEET, timeout=2)
