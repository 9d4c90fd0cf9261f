"""Benchmark math with exact numbers: percentiles, TPOT, ITL, goodput, cost, BCR, summaries."""

from __future__ import annotations

import pytest

from pdd.bench.serve.client import PddFacts, RequestRecord
from pdd.bench.serve.config import SlaConfig
from pdd.bench.serve.metrics import (
    bcr,
    cost_per_hour,
    gaps,
    goodput,
    meets_sla,
    percentile,
    summarize,
    time_to_nth,
    tpot,
)
from pdd.errors import ConfigError

SLA = SlaConfig(ttft_s=1.0, tpot_s=0.1)


def rec(index, ttft, e2e, tokens, chunks=(), *, warmup=False, error=None, **kw):
    return RequestRecord(
        index=index,
        group="g",
        warmup=warmup,
        conversation=f"c{index}",
        max_tokens=tokens,
        ttft_s=ttft,
        e2e_s=e2e,
        chunk_s=list(chunks),
        output_tokens=tokens,
        error=error,
        **kw,
    )


def test_percentile_interpolates_linearly():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 100) == 5.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_tpot_and_gaps():
    assert tpot(0.5, 2.5, 5) == 0.5  # (2.5 - 0.5) / (5 - 1)
    assert tpot(0.5, 0.5, 1) is None
    assert tpot(0.5, 0.5, 0) is None
    assert gaps([0.5, 0.75, 1.5, 1.625]) == [0.25, 0.75, 0.125]
    assert gaps([0.5]) == []


def test_time_to_the_32nd_token_counts_only_streams_that_long():
    long = [0.5 + 0.1 * i for i in range(40)]
    assert time_to_nth(rec(0, 0.5, 4.4, 40, long)) == pytest.approx(3.6)  # chunk 32 of 40
    assert time_to_nth(rec(1, 0.5, 1.0, 31, long[:31])) is None
    assert time_to_nth(rec(2, 0.5, 4.4, 40, long, error="cut")) is None
    s = summarize([rec(0, 0.5, 4.4, 40, long), rec(1, 0.5, 1.0, 31, long[:31])], 5.0, SLA, 0.0)
    assert (s.t32_p50_s, s.t32_p90_s) == (pytest.approx(3.6), pytest.approx(3.6))


def test_sla_and_goodput():
    records = [
        rec(0, 0.5, 1.4, 10),  # TPOT 0.1: meets
        rec(1, 1.5, 1.6, 2),  # TTFT too slow
        rec(2, 0.5, 2.5, 11),  # TPOT 0.2: too slow
        rec(3, 0.9, 0.9, 1),  # one token: TPOT undefined, meets
        rec(4, None, 0.1, 0, error="HTTP 503"),  # failed
    ]
    assert [meets_sla(r, SLA) for r in records] == [True, False, False, True, False]
    assert goodput(records, SLA, 4.0) == 0.5
    assert goodput(records, SLA, 0.0) == 0.0


def test_cost_and_bcr():
    assert cost_per_hour({"gpu_a": 2, "gpu_b": 1}, {"gpu_a": 2.0, "gpu_b": 2.5}) == 6.5
    assert cost_per_hour({}, {"gpu_a": 2.0}) == 0.0
    with pytest.raises(ConfigError, match=r"no cost.per_hour for worker kind\(s\) \['tpu'\]"):
        cost_per_hour({"tpu": 1}, {"gpu_a": 2.0})
    assert bcr(1.3, 6.5) == pytest.approx(0.2)
    assert bcr(1.3, 0.0) is None


def test_summary_numbers():
    facts = PddFacts(
        pipeline="p_rld_md", md_cached_tokens=900, wan_kv_bytes=1000, rld_tokens=3,
        handoff="one_shot", handoff_rounds=1,
    )  # fmt: skip
    records = [
        rec(0, 0.25, 1.25, 11, [0.25, 0.5, 1.25], prompt_tokens=1000, cached_tokens=960,
            pdd=facts, target_hit=0.96),
        rec(1, 0.5, 0.75, 2, [0.5, 0.75], prompt_tokens=1000, cached_tokens=0, target_hit=0.5),
        rec(2, 3.0, 3.0, 1, [3.0], prompt_tokens=500),
        rec(3, None, 0.1, 0, error="HTTP 503: busy"),
        rec(4, 0.1, 0.2, 2, [0.1, 0.2], warmup=True, prompt_tokens=99),
    ]  # fmt: skip
    s = summarize(records, wall_s=4.0, sla=SLA, cost=2.0, not_sent=2)
    assert (s.requests, s.ok, s.errors, s.not_sent) == (4, 3, 1, 2)
    assert (s.ttft_p50_s, s.e2e_p50_s) == (0.5, 1.25)
    assert s.ttft_p99_s == pytest.approx(2.95)
    assert (s.tpot_p50_s, s.tpot_p99_s) == (pytest.approx(0.175), pytest.approx(0.2485))
    assert (s.itl_p50_s, s.max_stall_s) == (0.25, 0.75)
    assert s.output_tokens == 14 and s.output_tok_s == 3.5
    assert (s.sla_ok, s.sla_attainment, s.goodput_rps) == (1, 0.25, 0.25)
    assert (s.wan_bytes_total, s.wan_bytes_per_request) == (1000, pytest.approx(1000 / 3))
    assert s.prefix_hit_rate == pytest.approx(960 / 2500)
    assert s.drc_hit_rate == pytest.approx(900 / 2500)
    assert s.rld_token_share == pytest.approx(3 / 14)
    assert s.target_hit_mean == pytest.approx(0.73)
    assert s.pipelines == {"none": 2, "p_rld_md": 1}
    assert s.handoffs == {"none": 2, "one_shot": 1}
    assert s.handoff_rounds_mean == 1.0
    assert (s.cost_per_hour, s.bcr) == (2.0, 0.125)
    assert s.first_errors == ["HTTP 503: busy"]


def test_summary_of_nothing():
    s = summarize([], wall_s=0.0, sla=SLA, cost=0.0)
    assert (s.requests, s.goodput_rps, s.ttft_p50_s, s.bcr, s.sla_attainment) == (
        0, 0.0, None, None, None,
    )  # fmt: skip
