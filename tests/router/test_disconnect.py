"""Client disconnects and overload: the worker always ends with 0 running requests."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import httpx
import pytest

from tests.router.conftest import wait_until
from tests.router.harness import MAX_QUEUED

MODEL = "SmolLM2-135M-Instruct"


def endless(router, first_delay_s: float = 0.0) -> None:
    s = router.fake.script
    s.tokens = router.codec.encode(" la", add_special_tokens=False)
    s.repeat, s.step_delay_s, s.first_delay_s = True, 0.02, first_delay_s


def in_flight(router) -> int:
    return httpx.get(router.root + "/debug/workers").json()["in_flight"]


def assert_cleaned_up(router, n: int = 1) -> None:
    """The worker saw ``n`` requests (a request's choices), and each was aborted and ended."""
    wait_until(lambda: len(router.fake.requests) == n, "worker never saw the request")
    rids = {q.request_id for q in router.fake.requests}
    wait_until(lambda: not router.fake.running, "worker still runs the abandoned request")
    wait_until(lambda: rids <= set(router.fake.aborts), "router did not send Abort")
    wait_until(lambda: all(router.fake.stream_stopped(r) for r in rids),
               "the worker's stream still runs")  # fmt: skip
    wait_until(lambda: in_flight(router) == 0, "router still counts the request in flight")


def read_then_leave(router, path: str, body: dict, done: Callable[[list[str]], bool]) -> None:
    """Stream ``body`` from ``path``; disconnect once ``done(the lines read so far)``."""
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", router.url + path, json=body) as r:
            assert r.status_code == 200
            lines: list[str] = []
            for line in r.iter_lines():
                lines.append(line)
                if done(lines):
                    break


def test_disconnect_mid_stream_cancels_and_aborts(router):
    endless(router)
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 400}
    read_then_leave(router, "/completions", body,
                    lambda lines: sum(x.startswith("data: {") for x in lines) == 3)  # fmt: skip
    assert_cleaned_up(router)
    metrics = httpx.get(router.root + "/metrics").text
    assert 'pdd_requests_total{finish_reason="abort",pipeline="colocated"}' in metrics


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_first_token(router, stream):
    endless(router, first_delay_s=30.0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": stream}
    with httpx.Client(timeout=httpx.Timeout(10, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(router.url + "/chat/completions", json=body)
    assert_cleaned_up(router)


def test_overload_is_429_then_recovers(router):
    endless(router)
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 400}
    with httpx.Client(timeout=10) as http, contextlib.ExitStack() as streams:
        for _ in range(MAX_QUEUED):
            r = streams.enter_context(http.stream("POST", router.url + "/completions", json=body))
            assert r.status_code == 200
        r = http.post(router.url + "/completions", json={**body, "stream": False})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert len(router.fake.requests) == MAX_QUEUED
    wait_until(lambda: not router.fake.running, "worker still runs the closed streams")
    wait_until(lambda: in_flight(router) == 0, "router still counts requests in flight")
    assert sorted(router.fake.aborts) == sorted(r.request_id for r in router.fake.requests)
    router.fake.script.repeat = False
    router.fake.script.tokens = [2]
    assert (
        httpx.post(router.url + "/completions", json={"model": MODEL, "prompt": "x"}).status_code
        == 200
    )


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_with_several_choices_ends_each(router, stream):
    """n=2: each choice is a request of its own; a client gone mid-answer ends both."""
    endless(router)
    body = {"model": MODEL, "prompt": "x", "n": 2, "stream": stream, "max_tokens": 400}

    def both_choices_seen(lines: list[str]) -> bool:
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        return {c["choices"][0]["index"] for c in chunks} == {0, 1}

    if stream:
        read_then_leave(router, "/completions", body, both_choices_seen)
    else:
        with httpx.Client(timeout=httpx.Timeout(10, read=0.5)) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post(router.url + "/completions", json=body)
    assert_cleaned_up(router, n=2)


def test_disconnect_mid_responses_stream_cancels_and_aborts(router):
    endless(router)
    body = {"model": MODEL, "input": "x", "stream": True, "max_output_tokens": 400}
    read_then_leave(router, "/responses", body,
                    lambda lines: lines.count("event: response.output_text.delta") == 3)  # fmt: skip
    assert_cleaned_up(router)
