"""The headline comparison (pdd against pd_wan): figures, targets met or missed, metering."""

from __future__ import annotations

import pytest

from pdd.bench.serve.compare import checks, compare, markdown
from pdd.bench.serve.config import CompareConfig
from pdd.bench.serve.metrics import Summary
from pdd.bench.serve.results import ModeResult, WorkloadResult


def _summary(**kw) -> Summary:
    return Summary(**kw)


BASE = dict(ttft_p90_s=4.0, ttft_p99_s=8.0, wan_bytes_total=1000, goodput_rps=0.5)


def test_targets_met():
    cand = _summary(ttft_p90_s=1.0, ttft_p99_s=2.0, wan_bytes_total=100, goodput_rps=0.75,
                    rld_token_share=0.05)  # fmt: skip
    rows = {c.metric: c for c in checks(_summary(**BASE), cand, CompareConfig())}
    assert rows["P90 TTFT reduction"].value == pytest.approx(0.75)
    assert rows["P99 TTFT reduction"].value == pytest.approx(0.75)
    assert rows["WAN KV bytes (queued for MD) factor"].value == pytest.approx(10.0)
    assert rows["SLA goodput gain"].value == pytest.approx(0.5)
    assert rows["RLD share of output tokens"].value == 0.05
    assert all(c.met for c in rows.values())


def test_targets_missed_and_unmeasurable():
    cand = _summary(ttft_p90_s=3.0, ttft_p99_s=None, wan_bytes_total=400, goodput_rps=0.55,
                    rld_token_share=0.2)  # fmt: skip
    rows = {c.metric: c for c in checks(_summary(**BASE), cand, CompareConfig())}
    assert rows["P90 TTFT reduction"].met is False
    assert rows["P99 TTFT reduction"].met is None  # no candidate P99: not measured
    assert rows["WAN KV bytes (queued for MD) factor"].met is False  # 2.5x < 5x
    assert rows["SLA goodput gain"].met is False  # +10% < +20%
    assert rows["RLD share of output tokens"].met is False


def test_metered_link_bytes_win_over_queued_kv_bytes():
    base = _summary(**BASE, link_bytes_total=2000)
    cand = _summary(wan_bytes_total=100, link_bytes_total=250)
    wan = checks(base, cand, CompareConfig())[2]
    assert (wan.metric, wan.value) == ("WAN bytes (link, metered) factor", 8.0)


def _mode(name: str, summary: Summary, errors: int = 0) -> ModeResult:
    m = ModeResult(name, {}, 0.0)
    m.workloads["agentic"] = WorkloadResult("agentic", [], {}, {}, summary)
    m.error = "did not start" if errors else None
    return m


def test_compare_needs_both_modes_and_counts_every_failure():
    cfg = CompareConfig()
    assert compare([_mode("pd_wan", _summary(**BASE))], cfg) is None
    good = _summary(ttft_p90_s=1.0, ttft_p99_s=2.0, wan_bytes_total=100, goodput_rps=0.75)
    result = compare([_mode("pd_wan", _summary(**BASE)), _mode("pdd", good),
                      _mode("colocated", _summary(), errors=1)], cfg)  # fmt: skip
    assert result is not None
    assert result["errors_by_mode"] == {"pd_wan": 0, "pdd": 0, "colocated": 1}
    last = result["checks"][-1]
    assert (last["metric"], last["value"], last["met"]) == ("failed requests (all modes)", 1, False)
    table = "\n".join(markdown(result))
    assert "| P90 TTFT reduction | 4000 ms | 1000 ms | 75.0% | >= 50% | yes |" in table
    assert "| failed requests (all modes) | 0 | 0 | 1 | == 0 | **no** |" in table
