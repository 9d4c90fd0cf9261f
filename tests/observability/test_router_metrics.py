"""The router's /metrics against the catalog, and the economics series (TPOT, SLA goodput,
cost per hour, workers per role) with exact values."""

from __future__ import annotations

import httpx
import pytest

from pdd.config import PddConfig
from pdd.observability import catalog
from pdd.protocol import Pipeline, Role
from pdd.router.decide.view import Decision
from pdd.router.metrics import RouterMetrics
from pdd.router.record import RequestRecord
from tests.observability.scrape import parse, value
from tests.router.test_pdd_flow import complete, script

ROUTER_SPECS = {m.name: m for m in catalog.exported_by(catalog.ROUTER)}


def scrape(h) -> dict:  # type: ignore[no-untyped-def]
    return parse(httpx.get(h.root + "/metrics", timeout=5).text)


def test_router_registers_exactly_its_catalog_metrics(pdd):
    """Every router metric of the catalog is a `# HELP` line of the running router's /metrics,
    with the catalog's type and labels, and the router exports nothing the catalog lacks."""
    script(pdd, 8)
    complete(pdd, "p_rld_md", "one_shot")
    text = httpx.get(pdd.root + "/metrics", timeout=5).text
    helped = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    helped = {n for n in helped if not n.endswith("_created")}
    assert helped == set(ROUTER_SPECS)
    for name, fam in parse(text).items():
        spec = ROUTER_SPECS[name]
        assert fam.kind == spec.kind.value, name
        assert fam.labels() - {"le"} <= set(spec.labels), name
    assert "cmpl-" not in text  # never a request id in a label


def test_economics_series(pdd):
    before = scrape(pdd)
    ids = script(pdd, 8)
    body = complete(pdd, "p_md").json()
    after = scrape(pdd)
    assert body["usage"]["completion_tokens"] == len(ids)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # One p_md request with 9 tokens: one TPOT sample, within the harness's SLA (5 s, 1 s).
    assert moved("pdd_request_time_per_output_token_seconds", pipeline="p_md") == 1
    assert moved("pdd_sla_good_requests_total", pipeline="p_md") == 1
    assert moved("pdd_requests_total", pipeline="p_md", finish_reason="stop") == 1
    cost = after["pdd_worker_cost_per_hour"]
    assert {dict(labels)["worker"]: v for (_, labels), v in cost.samples.items()} == {
        "p0": 1.0, "rld0": 1.0, "md0": 1.25,
    }  # fmt: skip
    workers = after["pdd_workers"]
    assert {dict(labels)["role"]: v for (_, labels), v in workers.samples.items()} == {
        "prefill": 1, "relay_decode": 1, "main_decode": 1,
    }  # fmt: skip


def _record(tokens: int, ttft: float, e2e: float, finish: str = "stop") -> RequestRecord:
    decision = Decision(Pipeline.COLOCATED, ((Role.COLOCATED, "w0"),))
    r = RequestRecord("cmpl-x", decision, arrival=100.0, routed_at=100.0, prompt_tokens=5)
    r.on_tokens(1, 100.0 + ttft, "w0")
    r.close(100.0 + e2e, finish, tokens, 0)
    return r


@pytest.mark.parametrize(
    ("tokens", "ttft", "e2e", "finish", "tpot", "good"),
    [
        (11, 0.5, 1.5, "stop", 0.1, True),  # exactly at both limits
        (11, 0.5, 1.6, "length", 0.11, False),  # TPOT over
        (11, 0.6, 1.6, "stop", 0.1, False),  # TTFT over
        (1, 0.5, 9.0, "stop", None, True),  # one token: no TPOT to miss
        (11, 0.1, 0.2, "abort", 0.01, False),  # not finished normally
        (11, 0.1, 0.2, "error", 0.01, False),
    ],
)
def test_tpot_and_sla(tokens, ttft, e2e, finish, tpot, good):
    r = _record(tokens, ttft, e2e, finish)
    assert r.tpot == (None if tpot is None else pytest.approx(tpot))
    assert r.meets_sla(0.5, 0.1) is good
    cfg = PddConfig.model_validate({"router": {"sla_ttft_s": 0.5, "sla_tpot_s": 0.1}})
    m = RouterMetrics(cfg)
    m.observe(r)
    good_count = m.registry.get_sample_value(
        "pdd_sla_good_requests_total", {"pipeline": "colocated"}
    )
    assert good_count == (1.0 if good else None)
