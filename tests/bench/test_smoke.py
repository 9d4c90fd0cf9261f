"""`pdd bench serve --config configs/bench/local.yaml --short --modes pd_wan,pdd,vllm_nixl` as
`make test` runs it: the benchmark starts each mode's topology itself (`pdd serve` of the
shipped configs, real vLLM workers, the default model; for vllm_nixl vLLM's own `vllm serve` P
and D with NixlConnector behind its proxy flow), runs every workload, stops it. Left out here, each
costing a minute or two of the suite: pd_local (pd_wan's topology on a local link;
tests/e2e/test_pdd_local.py serves it against one engine's tokens) and colocated (one engine;
tests/e2e/test_serve_colocated.py serves it against vLLM's own tokens).

Checks: every mode completes with zero errors, the report files exist with the pdd-vs-pd_wan
comparison, each mode ran the pipelines it stands for, pd_wan's D and pdd's MD found the
agentic warm turns in their DRC and vLLM's D in its prefix cache, the sweep's prefix hits reach
P's prefix cache as built,
nothing is left running. The targets themselves are judged by the full run (configs/bench/wan.yaml).

(It starts the systems through the benchmark's own mode runner rather than tests/helpers.py
``serve()``: that helper matches ``pdd ready:`` only at the start of a line, and `pdd serve`
can print a child's line into the middle of its ready line.)
"""

from __future__ import annotations

import json
import os
import time

import pytest

from pdd.bench.serve import main
from pdd.config import load_config
from tests.helpers import children_of

pytestmark = pytest.mark.slow

CONFIG = "configs/bench/local.yaml"
MODES = ["pd_wan", "pdd", "vllm_nixl"]
FILES = ["results.json", "requests.jsonl", "report.md", "ttft_cdf.png", "bathtub.png",
         "wan_bytes.png", "serve-pd_wan.log", "serve-pdd.log",
         *(f"serve-vllm_nixl-{p}.log" for p in ("p", "d", "proxy"))]  # fmt: skip
# vLLM's server reports no pdd facts: its requests count under pipeline "none"
PIPELINES = {"pd_wan": {"pd"}, "pdd": {"p_md", "p_rld_md"}, "vllm_nixl": {"none"}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    t0 = time.monotonic()
    # An SLA every machine meets, loaded or not: the smoke shows goodput is counted (a request
    # within the SLA counts); whether this CPU meets the benchmark's real SLA is not its business.
    sla = ["--set", "sla.ttft_s=600", "--set", "sla.tpot_s=60"]
    code = main(["--config", CONFIG, "--short", "--modes", ",".join(MODES), *sla,
                 "--out", str(out)])  # fmt: skip
    print(f"bench --short over {len(MODES)} modes took {time.monotonic() - t0:.1f}s")
    assert children_of(os.getpid()) == []
    return code, out, json.loads((out / "results.json").read_text())


def test_every_mode_completes_with_zero_errors(run):
    code, out, data = run
    logs = sorted(out.glob("serve-*.log"))
    tails = {p.name: p.read_text()[-2000:] for p in logs}
    assert code == 0, tails
    assert list(data["modes"]) == MODES
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    lines = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    for mode_name, mode in data["modes"].items():
        assert mode["error"] is None, mode_name
        assert set(mode["workloads"]) == {"agentic", "sweep"}
        for wl_name, wl in mode["workloads"].items():
            s = wl["summary"]
            where = (mode_name, wl_name, s["first_errors"])
            assert (s["errors"], wl["warmup_errors"], s["not_sent"]) == (0, 0, 0), where
            assert s["ok"] == s["requests"] == data["workloads"][wl_name]["measured"], where
            assert s["ttft_p50_s"] > 0 and s["goodput_rps"] > 0, where
            assert set(s["pipelines"]) <= PIPELINES[mode_name], where
            rows = [r for r in lines if (r["mode"], r["workload"]) == (mode_name, wl_name)
                    and not r["warmup"]]  # fmt: skip  # requests.jsonl: every measured request
            assert len(rows) == s["requests"] and all(r["error"] is None and r["ttft_s"] > 0
                                                      for r in rows)  # fmt: skip


def test_report_compares_pdd_with_pd_wan(run):
    _, out, data = run
    comparison = data["comparison"]
    assert (comparison["baseline"], comparison["candidate"]) == ("pd_wan", "pdd")
    metrics = [c["metric"] for c in comparison["checks"]]
    assert metrics[:2] == ["P90 TTFT reduction", "P99 TTFT reduction"]
    assert comparison["checks"][-1]["value"] == 0  # failed requests, every mode
    assert "## pdd vs pd_wan (`agentic`)" in (out / "report.md").read_text()
    # pd_wan's D and pdd's MD each get only the blocks their DRC lacks (as vLLM's decoder
    # pulls only what its prefix cache lacks): the warm turns find their history there.
    agentic = {m: data["modes"][m]["workloads"]["agentic"]["summary"] for m in MODES}
    for mode in ("pd_wan", "pdd"):
        assert agentic[mode]["wan_bytes_total"] > 0 and agentic[mode]["drc_hit_rate"] > 0, mode
    # vLLM's D, the real peer: the warm turns' history is in its own prefix cache (its usage's
    # cached_tokens count only D's local hits; what D pulls from P is not counted there)
    assert agentic["vllm_nixl"]["prefix_hit_rate"] > 0


def test_sweep_hits_reach_the_engine_cache(run):
    # The sweep's shared prefixes land in P's vLLM prefix cache, in whole blocks; a fully
    # cached prompt still computes its last token (usage.cached_tokens is P's hit).
    _, _, data = run
    block = load_config("configs/local.yaml").engine.block_size
    length = data["config"]["sweep"]["prompt_tokens"]
    groups = data["modes"]["pdd"]["workloads"]["sweep"]["groups"]
    for hit in data["config"]["sweep"]["buckets"]:
        shared = min(round(hit * length), length - 1)
        expected = (shared // block) * block / length
        assert groups[f"hit={hit:g}"]["prefix_hit_rate"] == expected, hit
