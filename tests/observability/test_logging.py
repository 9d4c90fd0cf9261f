"""Structured logs: text or JSON lines carrying the request id, in the router (bound per HTTP
request) and in a gRPC server (bound from the caller's x-request-id metadata)."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
from collections.abc import Iterator

import grpc
import httpx
import pytest

from pdd.observability.context import (
    RequestIdServerInterceptor,
    bind_request,
    current_request_id,
    request_context_interceptors,
)
from pdd.observability.logging import setup_logging
from pdd.proto import worker_pb2, worker_pb2_grpc
from tests.router.fake_worker import FakeWorker
from tests.router.harness import RouterHarness

log = logging.getLogger("pdd.test")


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_lines(restore_root):
    buf = io.StringIO()
    setup_logging("info", True, role="prefill", worker="p0", stream=buf)
    setup_logging("info", True, role="prefill", worker="p0", stream=buf)  # idempotent

    async def in_a_request() -> None:
        bind_request("cmpl-1")
        await asyncio.create_task(asyncio.sleep(0))  # tasks inherit the request
        log.info("inside %s", "the request")

    asyncio.run(in_a_request())
    log.debug("dropped: below INFO")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("outside")
    first, second = lines(buf)
    assert first["ts"].endswith("Z") and len(first["ts"]) == 24
    assert {k: v for k, v in first.items() if k != "ts"} == {
        "level": "INFO", "logger": "pdd.test", "msg": "inside the request", "role": "prefill",
        "worker": "p0", "request_id": "cmpl-1",
    }  # fmt: skip
    assert "request_id" not in second and second["level"] == "ERROR"
    assert second["exc"].endswith("ValueError: boom")


def test_text_lines_and_environment(restore_root, monkeypatch):
    monkeypatch.setenv("PDD_LOG_LEVEL", "warning")
    monkeypatch.delenv("PDD_LOG_JSON", raising=False)
    buf = io.StringIO()
    setup_logging(stream=buf)

    def in_a_request() -> None:
        bind_request("cmpl-2")
        log.info("dropped: below WARNING")
        log.warning("kept")

    contextvars.Context().run(in_a_request)  # the binding stays in that context
    (line,) = buf.getvalue().splitlines()
    assert line.endswith(" WARNING pdd.test [cmpl-2]: kept")
    monkeypatch.setenv("PDD_LOG_JSON", "1")
    buf = io.StringIO()
    setup_logging(stream=buf)
    log.warning("as json")
    assert lines(buf)[0]["msg"] == "as json"


def test_router_logs_carry_the_request_id(codec, restore_root):
    buf = io.StringIO()
    setup_logging("INFO", True, role="router", stream=buf)
    h = RouterHarness(codec, log_requests=True)
    h.start()
    try:
        r = httpx.post(h.url + "/completions", json={"prompt": "x", "max_tokens": 3}, timeout=10)
        rid = r.json()["id"]
    finally:
        h.stop()
    (record,) = [x for x in lines(buf) if x["msg"].startswith("request ")]
    assert record["msg"].startswith(f"request {rid} pipeline=colocated")
    assert (record["request_id"], record["role"], record["logger"]) == (
        rid, "router", "pdd.router.service",
    )  # fmt: skip


class _Recording(FakeWorker):
    seen: list[str | None]

    async def Health(self, request, context):  # noqa: N802
        self.seen.append(current_request_id())
        return await super().Health(request, context)


def test_workers_bind_the_request_id_from_grpc_metadata():
    async def scenario() -> list[str | None]:
        fake = _Recording("w0")
        fake.seen = []
        server = grpc.aio.server(interceptors=[RequestIdServerInterceptor()])
        worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=request_context_interceptors("w0")
        )
        try:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await stub.Health(worker_pb2.HealthRequest(), timeout=5)  # no request bound

            async def in_request() -> None:
                bind_request("cmpl-3")
                await stub.Health(worker_pb2.HealthRequest(), timeout=5)

            await asyncio.create_task(in_request())
            return fake.seen
        finally:
            await channel.close()
            await server.stop(None)

    assert asyncio.run(scenario()) == [None, "cmpl-3"]
