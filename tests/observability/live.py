"""Every metric the dashboard reads exists on a running PDD system and moves under traffic.

`dashboard_gaps` scrapes the router and every worker's /metrics the way Prometheus does
(asking for OpenMetrics), sends requests down each pipeline (p_md, p_rld_md with One-Shot and
Catch-Up, and a second turn of a conversation, so MD's DRC hits), scrapes again, and checks
each dashboard metric: present on every process the catalog says exports it, and, for counters
and histograms, increased on at least one of them (RLD's engine prefix cache, say, never
counts: RLD loads every prompt block from P). The system it runs on is the suite's own P, RLD
and MD (tests/e2e/test_pdd_local.py), under a router whose SLA every request meets.
"""

from __future__ import annotations

import httpx

from pdd.observability import catalog
from pdd.observability.catalog import Kind, MetricSpec
from pdd.observability.dashboard import dashboard_metrics, load
from tests.observability.scrape import PROMETHEUS_ACCEPT, samples

SLA = ["router.sla_ttft_s=120", "router.sla_tpot_s=10"]  # every request counts as good here
# Counters that need rare events to move (evictions, failures, MD's prefill beating this
# host's link): they must exist only.
QUIET = {"pdd_drc_evicted_blocks_total", "pdd_requests_rejected_total", "pdd_md_computed_total"}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"


def _prompt(seed: int, words: int = 600) -> str:
    w = WORDS.split()
    return " ".join(w[(seed * 7 + i * 3) % len(w)] + str(i % 13) for i in range(words))


def _complete(url: str, prompt: str, pipeline: str, handoff: str = "auto") -> dict:
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "pdd": {"pipeline": pipeline, "handoff": handoff}}  # fmt: skip
    r = httpx.post(url + "/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _traffic(url: str) -> None:
    first = _prompt(1)
    _complete(url, first, "p_md")
    _complete(url, first + " " + _prompt(2, 200), "p_md")  # second turn: MD's DRC hits
    _complete(url, _prompt(3), "p_rld_md", "one_shot")
    _complete(url, _prompt(4), "p_rld_md", "catch_up")
    _complete(url, _prompt(5, 100), "auto")


def _scrape(url: str) -> dict[str, float]:
    """Sample sums by series name, scraped as Prometheus does (asking for OpenMetrics)."""
    r = httpx.get(url, headers={"Accept": PROMETHEUS_ACCEPT}, timeout=10)
    assert r.status_code == 200, r.text
    return samples(r.text)


def _scrape_all(url: str, metrics_urls: dict[str, str]) -> dict[str, dict[str, float]]:
    out = {"router": _scrape(url.removesuffix("/v1") + "/metrics")}
    for wid, murl in metrics_urls.items():
        out[wid] = _scrape(murl)
    return out


def _present(spec: MetricSpec, scraped: dict[str, float]) -> bool:
    return all(series in scraped for series in spec.series)


def _moved(spec: MetricSpec, before: dict[str, float], after: dict[str, float]) -> bool:
    if spec.kind is Kind.GAUGE or spec.name in QUIET:
        return True
    series = f"{spec.name}_count" if spec.kind is Kind.HISTOGRAM else spec.name
    return after[series] > before.get(series, 0.0)


def dashboard_gaps(
    url: str, metrics_urls: dict[str, str], role_of: dict[str, str]
) -> tuple[dict[str, list[str]], list[str]]:
    """Traffic through the router at ``url`` (ending in /v1), scraped before and after at it
    and at each worker's ``metrics_urls``; ``role_of`` maps a worker id to its role. Returns
    (dashboard metric -> processes that lack it, dashboard metrics no process moved)."""
    before = _scrape_all(url, metrics_urls)
    _traffic(url)
    after = _scrape_all(url, metrics_urls)
    specs = {catalog.get(n).name: catalog.get(n) for n in dashboard_metrics(load())}
    missing: dict[str, list[str]] = {}
    still: list[str] = []
    for spec in specs.values():
        moved = False
        for proc, scraped in after.items():
            if (role_of.get(proc) or proc) not in spec.exporters:
                continue
            if not _present(spec, scraped):
                missing.setdefault(spec.name, []).append(proc)
            else:
                moved = moved or _moved(spec, before[proc], scraped)
        if not moved and spec.name not in missing:
            still.append(spec.name)
    return missing, still
