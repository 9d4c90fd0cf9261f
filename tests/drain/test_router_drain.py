"""Router drain (what SIGTERM does): the real router (uvicorn) over a fake worker. New
requests get 503 + Retry-After, /health 503, the open stream finishes whole, then the server
stops by itself; and a drain that runs out of time cancels what is left (aborted on the worker)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from pdd.router.text.tokenizer import TextCodec
from tests.helpers import wait_until
from tests.router.harness import RouterHarness

pytestmark = pytest.mark.timeout(60)
MODEL = "SmolLM2-135M-Instruct"
TOKENS = 20


def slow_stream(codec: TextCodec, drain_timeout_s: float) -> RouterHarness:
    h = RouterHarness(codec, drain_timeout_s=drain_timeout_s)
    h.start()
    h.fake.script.tokens = [330]  # any token, repeated: 20 steps of 50 ms
    h.fake.script.repeat = True
    h.fake.script.step_delay_s = 0.05
    return h


def stream_in_thread(h: RouterHarness, max_tokens: int, out: dict) -> threading.Thread:
    """POST a streaming completion; record its chunks; ``out['first']`` is set at chunk 1."""
    out["first"] = threading.Event()
    out["chunks"], out["done"] = [], False

    def run() -> None:
        body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": max_tokens,
                "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            with httpx.stream("POST", h.url + "/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        out["chunks"].append(json.loads(line[6:]))
                        out["first"].set()
        except httpx.HTTPError as exc:
            out["error"] = exc
        out["first"].set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_drain_refuses_new_requests_and_finishes_the_open_stream(codec):
    h = slow_stream(codec, drain_timeout_s=20)
    try:
        out: dict = {}
        t = stream_in_thread(h, TOKENS, out)
        assert out["first"].wait(10)
        h._server.drain()
        wait_until(lambda: httpx.get(h.root + "/health").status_code == 503, 5, "/health 503")
        r = httpx.post(h.url + "/completions", json={"model": MODEL, "prompt": "y"})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["type"] == "service_unavailable"
        assert error["message"].startswith("this router is shutting down (draining)")
        assert httpx.get(h.root + "/metrics").status_code == 200  # still observable
        t.join(20)
        assert out["done"] and "error" not in out
        finishes = [c["choices"][0]["finish_reason"] for c in out["chunks"] if c["choices"]]
        assert finishes[-1] == "length"
        assert out["chunks"][-1]["usage"]["completion_tokens"] == TOKENS
        wait_until(lambda: not h._thread.is_alive(), 10, "the router to stop after its drain")
        assert len(h.fake.requests) == 1 and h.fake.aborts == []
    finally:
        h.stop()


def test_a_drain_that_runs_out_of_time_cancels_the_rest_on_the_worker(codec):
    h = slow_stream(codec, drain_timeout_s=0.3)
    try:
        out: dict = {}
        t = stream_in_thread(h, 400, out)  # 20 s of tokens
        assert out["first"].wait(10)
        h._server.drain()
        wait_until(lambda: not h._thread.is_alive(), 20, "the router to stop after its drain")
        t.join(10)
        assert not out["done"]  # cut off, never completed
        rid = h.fake.requests[0].request_id
        assert h.fake.aborts == [rid] or rid in h.fake.cancelled
    finally:
        h.stop()
