"""A real `pdd serve` (router + one colocated vLLM worker) with API keys and a worker token:
clients need a key, the worker refuses gRPC without the token, no secret reaches a log line,
a metric or /debug/config, and (last) a worker that gets SIGTERM drains: new requests are
refused with 503 + Retry-After while its open stream finishes whole, then it exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import grpc
import httpx
import pytest

from pdd.proto import worker_pb2 as pb
from pdd.proto import worker_pb2_grpc as pb_grpc
from tests.helpers import children_of, serve, stop, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
API_KEY = "sk-pdd-soak-secret-api-key-0001"
TOKEN = "wk-pdd-secret-worker-token-9f8e7d6c5b4a"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secure")
    (tmp / "keys").write_text(API_KEY + "\n")
    (tmp / "token").write_text(TOKEN + "\n")
    s = serve(
        "configs/colocated.yaml",
        ["w0"],
        [
            f"router.api_keys_file={tmp / 'keys'}",
            f"security.worker_token_file={tmp / 'token'}",
            "engine.kv_cache_space_gib=0.25",
            "workers.0.drain_timeout_s=180",
        ],  # fmt: skip
        pin_metrics_ports=True,
    )
    try:
        yield s
    finally:
        stop(s)


def worker_health(served, metadata=()) -> grpc.StatusCode | bool:
    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{served.worker_ports['w0']}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            try:
                return (await stub.Health(pb.HealthRequest(), timeout=5, metadata=metadata)).ready
            except grpc.aio.AioRpcError as exc:
                return exc.code()

    return asyncio.run(go())


def test_clients_need_an_api_key(served):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
    assert httpx.post(served.url + "/completions", json=body, timeout=60).status_code == 401
    r = httpx.post(served.url + "/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_the_worker_refuses_grpc_without_the_token(served):
    assert worker_health(served) is grpc.StatusCode.UNAUTHENTICATED
    wrong = (("authorization", "Bearer wk-not-the-token-000000000"),)
    assert worker_health(served, wrong) is grpc.StatusCode.UNAUTHENTICATED
    assert worker_health(served, (("authorization", f"Bearer {TOKEN}"),)) is True
    health = httpx.get(served.url.removesuffix("/v1") + "/health", timeout=5).json()
    assert [w["healthy"] for w in health["workers"]] == [True]  # the router has the token


def test_no_secret_in_logs_metrics_or_config(served):
    root = served.url.removesuffix("/v1")
    texts = {
        "router /metrics": httpx.get(root + "/metrics", timeout=5).text,
        "worker /metrics": httpx.get(
            f"http://127.0.0.1:{served.metrics_ports['w0']}/metrics", timeout=5
        ).text,
        "/debug/config": httpx.get(root + "/debug/config", headers=AUTH, timeout=5).text,
    }
    wait_until(lambda: any("refused" in ln for ln in served.output), 10, "the refusal log line")
    texts["logs"] = "\n".join(served.output)
    assert "refused /pdd.worker.v1.Worker/Health: no worker credential" in texts["logs"]
    for where, text in texts.items():
        for secret in (API_KEY, TOKEN):
            assert secret not in text, f"a secret leaked into {where}"


def test_sigterm_drains_the_worker(served):
    """Last: the worker is gone afterwards (and `pdd serve` stops with it)."""
    (worker_pid,) = [p for p in children_of(served.proc.pid) if _is_worker(p)]
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    first, got = threading.Event(), {"chunks": 0, "done": False, "finish": None}

    def stream() -> None:
        with httpx.stream("POST", served.url + "/completions", json=body, headers=AUTH,
                          timeout=120) as r:  # fmt: skip
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    got["done"] = True
                elif line.startswith("data: {"):
                    got["chunks"] += 1
                    got["finish"] = _finish(line) or got["finish"]
                    first.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert first.wait(60)
    os.kill(worker_pid, signal.SIGTERM)
    refused = _refused_while_draining(served)
    t.join(120)
    assert (got["done"], got["finish"]) == (True, "length")  # finished whole, not aborted
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    wait_until(lambda: not os.path.exists(f"/proc/{worker_pid}"), 60, "the worker to exit")
    assert any("drained: nothing in flight" in ln for ln in served.output)


def _refused_while_draining(served) -> httpx.Response:
    """A new request once the worker drains: 503 (UNAVAILABLE from the worker, or no healthy
    worker once the router polled its Health)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

    def attempt():
        try:
            r = httpx.post(served.url + "/completions", json=body, headers=AUTH, timeout=30)
        except httpx.HTTPError:
            return None
        return r if r.status_code == 503 else None

    return wait_until(attempt, 30, "a 503 while the worker drains", interval_s=0.1)


def _finish(line: str) -> str | None:
    choices = json.loads(line[6:]).get("choices") or [{}]
    return choices[0].get("finish_reason")


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"pdd.launch.worker" in argv
