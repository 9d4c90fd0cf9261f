"""The client and the runner against a scripted fake server: what a record holds, how errors
read, turn ordering, the phase deadline, open-loop arrivals, and the request bodies."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from pdd.bench.serve.client import PddFacts, stream_request
from pdd.bench.serve.config import BenchConfig
from pdd.bench.serve.runner import PhaseRunner, Progress, api_base, poisson_offsets, run_mode
from pdd.bench.serve.workload import BenchRequest, Group, Workload
from pdd.errors import PddError
from tests.bench.fake_server import Answer, FakeServer

PDD = {
    "pipeline": "p_rld_md",
    "prompt_tokens": 100,
    "md_cached_tokens": 90,
    "wan_kv_bytes": 230400,
    "rld_tokens": 2,
    "handoff": "catch_up",
    "handoff_rounds": 3,
}


def req(name: str, index: int = 0, *, after=None, warmup=False, group="g", arrival=None):
    return BenchRequest(
        index=index,
        group=group,
        warmup=warmup,
        conversation=name,
        max_tokens=3,
        messages=(("user", name),),
        prompt_tokens=100,
        shared_tokens=50,
        after=after,
        arrival_s=arrival,
    )


async def _one(server: FakeServer, r: BenchRequest, timeout_s: float = 10.0):
    async with httpx.AsyncClient(base_url="http://fake/v1", transport=server.transport()) as http:
        return await stream_request(http, r, dict(r.payload(), model="m"), timeout_s, 0.0)


def test_record_of_a_pdd_stream():
    server = FakeServer({"a": Answer(tokens=3, delay_s=0.05, gap_s=0.02, pdd=PDD)})
    rec = asyncio.run(_one(server, req("a")))
    assert rec.ok, rec.error
    assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens) == (3, 100, 64)
    assert (rec.finish_reason, rec.status, rec.target_hit) == ("length", 200, 0.5)
    assert rec.pdd == PddFacts(**PDD)
    assert len(rec.chunk_s) == 3 and rec.ttft_s == rec.chunk_s[0]
    assert rec.ttft_s >= 0.05 and rec.chunk_s[2] - rec.chunk_s[0] >= 0.04
    assert rec.e2e_s >= rec.chunk_s[-1]


def test_missing_pdd_facts_read_as_zeros():
    rec = asyncio.run(_one(FakeServer({"a": Answer(pdd=None)}), req("a")))
    assert rec.ok and rec.pdd == PddFacts()
    assert (rec.pdd.pipeline, rec.pdd.handoff, rec.pdd.wan_kv_bytes) == ("none", "none", 0)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (Answer(status=503), 'HTTP 503: {"error":{"message":"busy"}}'),
        (Answer(tokens=0), "no tokens in the stream"),
        (Answer(finish=False), "stream ended early (no finish_reason, no [DONE])"),
        (Answer(error_chunk=True), "bad stream: error in stream: "),
        (Answer(pdd={"wan_kv_bytes": "lots"}), "bad stream: 1 validation error for PddFacts"),
        (Answer(delay_s=1.0), "timed out after 0.2s"),
    ],
)
def test_failures_become_error_records(answer, error):
    rec = asyncio.run(_one(FakeServer({"a": answer}), req("a"), timeout_s=0.2))
    assert not rec.ok
    assert rec.error.replace(" ", "").startswith(error.replace(" ", "")), rec.error
    assert rec.e2e_s is not None


def _cfg(**load) -> BenchConfig:
    return BenchConfig.model_validate({"load": load, "progress_interval_s": 60})


async def _phase(server: FakeServer, cfg: BenchConfig, wl: Workload):
    async with httpx.AsyncClient(base_url="http://fake/v1", transport=server.transport()) as http:
        runner = PhaseRunner(http, cfg, "fake-model", Progress(60))
        return await runner.run(wl, "test")


def test_a_turn_waits_for_the_request_that_sent_its_prefix():
    server = FakeServer({"first": Answer(delay_s=0.3)})
    reqs = [req("first", 0), req("other", 1), req("second", 2, after=0)]
    wl = Workload("w", [Group("g")], reqs)
    (phase,) = asyncio.run(_phase(server, _cfg(concurrency=3), wl))
    assert [r.index for r in phase.records] == [0, 1, 2]
    assert server.log["second"][0] >= server.log["first"][1]
    assert server.log["other"][0] < server.log["first"][1]  # not held back by the others


def test_no_request_is_sent_after_the_phase_duration():
    # One stream; each answer takes 1 s: requests start at 0 s and 1 s, then the 1.5 s bound.
    server = FakeServer({f"r{i}": Answer(delay_s=1.0) for i in range(5)})
    wl = Workload("w", [Group("g")], [req(f"r{i}", i) for i in range(5)])
    (phase,) = asyncio.run(_phase(server, _cfg(concurrency=1, duration_s=1.5), wl))
    assert [r.index for r in phase.records] == [0, 1]
    assert phase.not_sent == 3
    assert phase.wall_s >= 2.0


def test_warmup_runs_before_measured_requests_of_each_group():
    server = FakeServer()
    reqs = [
        req("g1-m", 0, group="g1"),
        req("g1-w", 1, group="g1", warmup=True),
        req("g2-w", 2, group="g2", warmup=True),
        req("g2-m", 3, group="g2"),
    ]
    wl = Workload("w", [Group("g1"), Group("g2")], reqs)
    phases = asyncio.run(_phase(server, _cfg(), wl))
    assert [(p.group, p.warmup, [r.index for r in p.records]) for p in phases] == [
        ("g1", True, [1]),
        ("g1", False, [0]),
        ("g2", True, [2]),
        ("g2", False, [3]),
    ]
    order = sorted(server.log, key=lambda n: server.log[n][0])
    assert order == ["g1-w", "g1-m", "g2-w", "g2-m"]


def test_open_loop_follows_the_seeded_poisson_schedule():
    cfg = _cfg(pattern="open", rate=20.0)
    wl = Workload("w", [Group("g")], [req(f"r{i}", i) for i in range(8)])
    (phase,) = asyncio.run(_phase(FakeServer(), cfg, wl))
    expected = poisson_offsets(20.0, 8, random.Random("arrivals-0-g"))
    for rec, at in zip(phase.records, expected, strict=True):
        assert at <= rec.sent_s < at + 2.0  # never early; late only by event-loop lag


def test_trace_arrivals_are_replayed():
    wl = Workload("w", [Group("g")], [req(f"r{i}", i, arrival=0.1 * i) for i in range(3)])
    (phase,) = asyncio.run(_phase(FakeServer(), _cfg(), wl))
    for i, rec in enumerate(phase.records):
        assert 0.1 * i <= rec.sent_s < 0.1 * i + 2.0


def test_poisson_offsets_are_seeded_with_the_right_mean():
    a = poisson_offsets(4.0, 4000, random.Random(1))
    assert a == poisson_offsets(4.0, 4000, random.Random(1))
    assert a == sorted(a)
    assert a[-1] / 4000 == pytest.approx(0.25, rel=0.05)


def test_run_mode_sends_the_configured_body_and_checks_the_context():
    server = FakeServer(health=[503, 503])
    cfg = BenchConfig.model_validate({"temperature": 0.5, "progress_interval_s": 60})
    wl = Workload("w", [Group("g")], [req("a", 0)])
    t0 = time.monotonic()
    phases = asyncio.run(run_mode(cfg, "http://fake", {"w": wl}, "m", server.transport()))
    assert time.monotonic() - t0 >= 0.5  # waited for /health twice
    assert [r.ok for r in phases["w"][0].records] == [True]
    assert server.bodies == [
        {
            "messages": [{"role": "user", "content": "a"}],
            "max_tokens": 3,
            "model": "fake-model",
            "temperature": 0.5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ]
    server.max_model_len = 102
    with pytest.raises(PddError, match="needs 103 tokens of context .* max_model_len is 102"):
        asyncio.run(run_mode(cfg, "http://fake/v1/", {"w": wl}, "m", server.transport()))


def test_run_mode_sends_the_api_key_on_every_request():
    server = FakeServer()
    cfg = BenchConfig.model_validate({"progress_interval_s": 60})
    wl = Workload("w", [Group("g")], [req("a", 0), req("b", 1)])
    asyncio.run(run_mode(cfg, "http://fake", {"w": wl}, "m", server.transport(), api_key="k1"))
    assert server.keys == ["Bearer k1", "Bearer k1"]


def test_api_base():
    assert api_base("http://h:1") == "http://h:1/v1"
    assert api_base("http://h:1/v1/") == "http://h:1/v1"


def test_timelines_keep_the_routers_view_of_each_request():
    view = {"request_id": "chatcmpl-a", "timeline": [{"at_ms": 0.0, "event": "arrival"}]}
    server = FakeServer(debug={"chatcmpl-a": view})
    wl = Workload("w", [Group("g")], [req("a", 0), req("b", 1)])
    for timelines, expected in ((True, [view, None]), (False, [None, None])):
        cfg = BenchConfig.model_validate({"progress_interval_s": 60, "timelines": timelines})
        phases = asyncio.run(run_mode(cfg, "http://fake", {"w": wl}, "m", server.transport()))
        records = phases["w"][0].records
        assert [r.response_id for r in records] == ["chatcmpl-a", "chatcmpl-b"]
        assert [r.debug for r in records] == expected  # b: not kept by the server (404)
        assert records[0].to_json()["debug"] == expected[0]
