"""Client disconnects and overload: the worker always ends with 0 running requests."""

from __future__ import annotations

import contextlib

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


def assert_cleaned_up(router) -> None:
    wait_until(lambda: len(router.fake.requests) == 1, "worker never saw the request")
    rid = router.fake.requests[0].request_id
    wait_until(lambda: not router.fake.running, "worker still runs the abandoned request")
    wait_until(lambda: rid in router.fake.aborts, "router did not send Abort")
    wait_until(lambda: router.fake.stream_stopped(rid), "the worker's stream still runs")
    wait_until(lambda: in_flight(router) == 0, "router still counts the request in flight")


def test_disconnect_mid_stream_cancels_and_aborts(router):
    endless(router)
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 400}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", router.url + "/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break
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
    with httpx.Client(timeout=httpx.Timeout(10, read=0.5)) as http:
        if stream:
            with http.stream("POST", router.url + "/completions", json=body) as r:
                assert r.status_code == 200
                indexes = set()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        indexes.add(
                            httpx.Response(200, content=line[6:]).json()["choices"][0]["index"]
                        )
                    if indexes == {0, 1}:
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(router.url + "/completions", json=body)
    wait_until(lambda: len(router.fake.requests) == 2, "worker never saw both choices")
    rids = {q.request_id for q in router.fake.requests}
    wait_until(lambda: rids <= set(router.fake.aborts), "router did not Abort both choices")
    wait_until(lambda: not router.fake.running, "worker still runs an abandoned choice")
    wait_until(lambda: in_flight(router) == 0, "router still counts a choice in flight")


def test_disconnect_mid_responses_stream_cancels_and_aborts(router):
    endless(router)
    body = {"model": MODEL, "input": "x", "stream": True, "max_output_tokens": 400}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", router.url + "/responses", json=body) as r:
            assert r.status_code == 200
            deltas = 0
            for line in r.iter_lines():
                deltas += line == "event: response.output_text.delta"
                if deltas == 3:
                    break
    assert_cleaned_up(router)
