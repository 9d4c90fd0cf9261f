"""Admission and deadlines through the real router app and fake gRPC workers.

Overload is 429 with Retry-After, no capacity is 503 with Retry-After, and a request past
``router.request_timeout_s`` ends with a 504 ``timeout_error`` (or, mid-stream, an error event
then ``[DONE]``) while the worker gets its stream cancelled and an Abort. A body over
``router.max_body_bytes`` is 413 however it is framed.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from pdd.router.http.limits import BodyLimitMiddleware
from pdd.router.text.tokenizer import TextCodec
from tests.router.conftest import wait_until
from tests.router.fake_worker import Script
from tests.router.harness import MAX_BODY_BYTES, MAX_QUEUED, RouterHarness

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TIMEOUT_S = 1.0


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def in_flight(h: RouterHarness) -> int:
    return httpx.get(h.root + "/debug/workers", timeout=5).json()["in_flight"]


def assert_aborted_and_released(h: RouterHarness, count: int) -> None:
    """The worker saw ``count`` requests; each was cancelled and aborted; nothing in flight."""
    wait_until(lambda: len(h.fake.requests) == count, "worker did not see every request")
    rids = sorted(r.request_id for r in h.fake.requests)
    wait_until(lambda: not h.fake.running, "worker still runs an abandoned request")
    wait_until(lambda: sorted(set(h.fake.aborts)) == rids, f"no Abort for all of {rids}")
    assert sorted(h.fake.cancelled) == rids  # the gRPC streams were cancelled as well
    wait_until(lambda: in_flight(h) == 0, "router still counts requests in flight")


def assert_serves(h: RouterHarness) -> None:
    h.fake.script = Script(tokens=[2])
    r = httpx.post(h.url + "/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200, r.text


def stuck(h: RouterHarness, *, first_delay_s: float = 0.0, step_delay_s: float = 0.0) -> None:
    s = h.fake.script
    s.tokens = h.codec.encode(" la", add_special_tokens=False)
    s.repeat, s.first_delay_s, s.step_delay_s = True, first_delay_s, step_delay_s


# --- admission: 429 / 503 -----------------------------------------------------------------


def test_full_queue_is_429_with_retry_after_and_never_reaches_the_worker(router):
    stuck(router, first_delay_s=60.0)  # every admitted request waits for its first token

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as http:
            slow = [
                asyncio.create_task(http.post(router.url + "/completions", json={"prompt": "x"}))
                for _ in range(MAX_QUEUED)
            ]
            deadline = time.monotonic() + 10
            while (await http.get(router.root + "/debug/workers")).json()["in_flight"] < MAX_QUEUED:
                assert time.monotonic() < deadline, "the slow requests were never admitted"
                await asyncio.sleep(0.01)
            refused = [
                await http.post(router.url + "/chat/completions", json=CHAT),
                await http.post(router.url + "/completions", json={"prompt": "x", "stream": True}),
            ]
            for task in slow:  # the clients give up: the router must abort all four
                task.cancel()
            await asyncio.gather(*slow, return_exceptions=True)
            return refused

    for r in asyncio.run(scenario()):
        err = error_of(r, 429)
        assert r.headers["retry-after"] == "1"
        assert (err["type"], err["param"], err["code"]) == ("rate_limit_error", None, None)
        assert f"({MAX_QUEUED} of {MAX_QUEUED})" in err["message"]
    assert_aborted_and_released(router, MAX_QUEUED)
    assert_serves(router)


def test_worker_out_of_resources_is_429_with_retry_after(router):
    router.fake.script.fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    for stream in (False, True):
        r = httpx.post(router.url + "/chat/completions", json={**CHAT, "stream": stream})
        err = error_of(r, 429)
        assert r.headers["retry-after"] == "1"
        assert err["type"] == "rate_limit_error"
    router.fake.script.fail_code = None
    assert_serves(router)


def test_pdd_fleet_without_healthy_workers_is_503_with_retry_after(pdd):
    for fake in pdd.fakes:
        fake.ready = False
    pdd.wait_health(503)
    try:
        for stream in (False, True):  # a stream too: no 200 before capacity is known
            r = httpx.post(pdd.url + "/chat/completions", json={**CHAT, "stream": stream})
            err = error_of(r, 503)
            assert r.headers["retry-after"] == "1"
            assert err["type"] == "service_unavailable"
        assert [f.requests for f in pdd.fakes] == [[], [], []]
    finally:
        for fake in pdd.fakes:
            fake.ready = True
        pdd.wait_all_healthy()


# --- the end-to-end deadline -----------------------------------------------------------------


@pytest.fixture(scope="module")
def deadline_harness(codec: TextCodec) -> Iterator[RouterHarness]:
    h = RouterHarness(codec, request_timeout_s=TIMEOUT_S)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def slow(deadline_harness: RouterHarness) -> Iterator[RouterHarness]:
    deadline_harness.reset()
    yield deadline_harness
    wait_until(lambda: not deadline_harness.fake.running, "fake still runs a request")


def assert_timeout_error(err: dict) -> None:
    assert (err["type"], err["param"], err["code"]) == ("timeout_error", None, "request_timeout")
    assert f"deadline of {TIMEOUT_S:g} s" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_stuck_worker_before_first_token_is_504_and_aborted(slow, stream):
    stuck(slow, first_delay_s=60.0)
    start = time.monotonic()
    r = httpx.post(slow.url + "/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
    elapsed = time.monotonic() - start
    assert_timeout_error(error_of(r, 504))
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 3.0
    assert_aborted_and_released(slow, 1)
    assert_serves(slow)


def test_stream_stalling_mid_way_ends_with_an_error_event_then_done(slow):
    stuck(slow, step_delay_s=60.0)  # one token at once, then nothing
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 100}
    with httpx.stream("POST", slow.url + "/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert lines[0].startswith('data: {"id":"cmpl-') and '"text":" la"' in lines[0]
    assert lines[-2].startswith('data: {"error":')
    assert_timeout_error(httpx.Response(200, content=lines[-2][6:]).json()["error"])
    assert len(lines) == 3
    assert_aborted_and_released(slow, 1)
    assert_serves(slow)


def test_request_within_the_deadline_is_untouched(slow):
    s = slow.fake.script
    s.tokens, s.step_delay_s = slow.codec.encode(" a b c", add_special_tokens=False) + [2], 0.05
    r = httpx.post(slow.url + "/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " a b c"
    assert slow.fake.aborts == []


# --- body size: chunked uploads and lying Content-Length -------------------------------------


def raw_exchange(h: RouterHarness, request: bytes) -> bytes:
    """Send raw bytes on a fresh connection; read one response (until close or its body)."""
    host, port = h.root.removeprefix("http://").rsplit(":", 1)
    data = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:  # the server may answer and close before it has read everything we send
            sock.sendall(request)
            while True:
                head, sep, body = data.partition(b"\r\n\r\n")
                if sep and len(body) >= int(_header(head, b"content-length") or 0):
                    return data
                chunk = sock.recv(65536)
                if not chunk:
                    return data
                data += chunk
        except (BrokenPipeError, ConnectionResetError):
            return data


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def chunked_upload(chunks: list[int], extra_headers: bytes = b"") -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (n, b"a" * n) for n in chunks) + b"0\r\n\r\n"
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: pdd\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n" + extra_headers + b"\r\n" + body
    )


def test_chunked_body_over_the_limit_is_413_without_content_length(router):
    # Just over the limit, so the server has read nearly all of it when it answers.
    response = raw_exchange(router, chunked_upload([16384] * 4 + [16]))
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ")
    err = httpx.Response(413, content=body).json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "payload_too_large")
    assert err["message"] == (
        f"request body too large: the limit is {MAX_BODY_BYTES} bytes, got more than that"
    )
    assert router.fake.requests == []
    assert_serves(router)


def test_content_length_contradicting_chunked_framing_is_refused(router):
    # Both framings at once is the request-smuggling shape: the server refuses it outright.
    response = raw_exchange(router, chunked_upload([], b"Content-Length: 10\r\n"))
    assert response.startswith(b"HTTP/1.1 400 ")
    assert router.fake.requests == []
    assert_serves(router)


def test_body_limit_counts_bytes_not_the_declared_length():
    """Behind a server or proxy that passes a lying Content-Length through, the limit holds."""
    reached: list[bytes] = []

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        reached.append((await receive())["body"])

    limited = BodyLimitMiddleware(app, max_body_bytes=100)
    sent: list[dict] = []
    parts = [b"x" * 60, b"x" * 60]

    async def receive() -> dict:
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-length", b"10")]}  # fmt: skip
    asyncio.run(limited(scope, receive, send))
    assert reached == []
    assert sent[0]["status"] == 413
    assert b"the limit is 100 bytes" in sent[1]["body"]
