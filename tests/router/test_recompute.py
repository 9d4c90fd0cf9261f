"""Recompute or wait (router.pdd.md_recompute) through the router's HTTP API, fake workers.

P measured a slow WAN (8,000 bit/s: 1 s per 1,000-byte block); MD reports the prefill rate its
engine measured. Where MD computes a miss sooner than the WAN carries it, the request goes
p_md, MD is never asked to reserve or receive KV: it computes the prompt while P prefills (a
warm-up whose token is dropped), then continues prompt + t1; where it does not (no rate
reported), the request goes as before."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdd.router.text.tokenizer import TextCodec
from tests.observability.scrape import parse, value
from tests.router.conftest import PDD_POLICY, assert_released, fresh, wait_until
from tests.router.harness import RouterHarness
from tests.router.test_pdd_flow import complete, prompt_ids, script


@pytest.fixture(scope="module")
def recompute(codec: TextCodec) -> Iterator[RouterHarness]:
    h = RouterHarness.pdd(codec, "pdd", **PDD_POLICY, md_recompute=True)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def pdd(recompute: RouterHarness) -> Iterator[RouterHarness]:
    fresh(recompute)
    yield recompute
    _md_rate(recompute, 0.0)
    assert_released(recompute)


def _md_rate(h: RouterHarness, rate: float) -> None:
    """MD reports ``rate``; returns once the router's view has it (its next Stats poll)."""
    h.by_id("md0").prefill_tokens_per_s = rate
    wait_until(lambda: _seen(h) == rate, "the router never saw MD's prefill rate")


def _seen(h: RouterHarness) -> float:
    (md,) = [w for w in h.workers() if w["id"] == "md0"]
    return md["prefill"]["tokens_per_s"]


def _computed(h: RouterHarness, pipeline: str) -> float:
    """pdd_md_computed_total{pipeline} as the router's /metrics has it (0 before the first)."""
    families = parse(httpx.get(h.root + "/metrics", timeout=5).text)
    name = "pdd_md_computed_total"
    return value(families, name, pipeline=pipeline) if name in families else 0.0


def test_md_that_computes_sooner_than_the_wan_gets_no_kv_and_the_whole_answer(pdd):
    ids = script(pdd, 6)
    _md_rate(pdd, 1e6)  # the prompt in microseconds against seconds of WAN
    before = _computed(pdd, "p_md")
    body = complete(pdd).json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    rec = body["pdd"]
    assert (rec["pipeline"], rec["md_computed"], rec["wan_kv_bytes"]) == ("p_md", True, 0)
    assert _computed(pdd, "p_md") == before + 1  # what an SRE's dashboard counts
    md, p = pdd.by_id("md0"), pdd.by_id("p0")
    assert (md.kv.prepares, md.kv.awaits, p.kv.sends) == ([], [], [])
    warm, final = md.requests  # the prompt while P prefilled, then prompt + t1 to the end
    assert (list(warm.prompt_token_ids), warm.sampling.max_tokens) == (prompt_ids(pdd), 1)
    assert list(final.prompt_token_ids) == prompt_ids(pdd) + ids[:1]


def test_md_with_no_measured_rate_waits_for_its_kv(pdd):
    ids = script(pdd, 6)
    before = _computed(pdd, "p_md")
    body = complete(pdd, "p_md").json()  # no rate: the WAN, however slow
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    rec = body["pdd"]
    assert (rec["pipeline"], rec["md_computed"]) == ("p_md", False)
    assert rec["wan_kv_bytes"] > 0
    assert len(pdd.by_id("md0").kv.prepares) == 1
    assert _computed(pdd, "p_md") == before


def test_a_request_that_ends_on_p_stops_md_s_warm_up(pdd):
    """P's token is EOS: the request ends there; MD's warm-up (held 5 s before its token) is
    cancelled, and nothing runs or stays reserved anywhere (the fixture checks)."""
    script(pdd, 0)
    md = pdd.by_id("md0")
    md.script.first_delay_s = 5.0
    _md_rate(pdd, 1e6)
    body = complete(pdd).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("", "stop")
    (warm,) = md.requests
    assert warm.request_id.endswith(".warm")
    wait_until(lambda: warm.request_id in md.cancelled, "MD's warm-up still runs")


def test_md_waiting_for_a_crawling_transfer_computes_the_rest_once_that_is_sooner(pdd):
    """The route waited for the KV (MD reported no rate yet); while the transfer crawls, MD
    reports a fast prefill: the next AwaitKv poll finds computing sooner, gives MD's
    reservation up (CancelKv, naming why) and MD's Generate computes the prompt: the whole
    answer, long before the 30 s the transfer would have taken."""
    from concurrent.futures import ThreadPoolExecutor

    ids = script(pdd, 6)
    md = pdd.by_id("md0")
    md.kv.land_delay_s = 30.0
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(complete, pdd, "p_md")
        wait_until(lambda: md.kv.awaits, "the router never waited for MD's KV")
        _md_rate(pdd, 1e6)
        body = answer.result(timeout=20).json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    rec = body["pdd"]
    assert (rec["pipeline"], rec["md_computed"]) == ("p_md", True)
    assert rec["wan_kv_bytes"] > 0  # the route sent it; the rest was given up
    assert [r for _, r in md.kv.cancels] == [
        "router: computing the rest is sooner than its transfer"
    ]
