"""Report generation from synthetic results: every file is written and says what it should."""

from __future__ import annotations

import json

from pdd.bench.serve.client import PddFacts, RequestRecord
from pdd.bench.serve.config import BenchConfig, SlaConfig
from pdd.bench.serve.report import write_report
from pdd.bench.serve.results import ModeResult, PhaseResult, WorkloadResult
from pdd.bench.serve.workload import BenchRequest, Group, Workload

SLA = SlaConfig(ttft_s=1.0, tpot_s=0.1)
PNG = b"\x89PNG\r\n\x1a\n"


def _rec(index, group, ttft, *, warmup=False, wan=0):
    return RequestRecord(
        index=index, group=group, warmup=warmup, conversation=f"c{index}", max_tokens=5,
        ttft_s=ttft, e2e_s=ttft + 0.2, chunk_s=[ttft, ttft + 0.1, ttft + 0.2], output_tokens=5,
        prompt_tokens=1000, cached_tokens=500, pdd=PddFacts(wan_kv_bytes=wan),
    )  # fmt: skip


def _sweep_workload():
    groups = [Group("hit=0", 0.0), Group("hit=1", 1.0)]
    reqs = []
    for g in groups:
        for warm in (True, False):
            reqs.append(
                BenchRequest(
                    index=len(reqs),
                    group=g.name,
                    warmup=warm,
                    conversation=g.name,
                    max_tokens=5,
                    messages=(("user", "x"),),
                    prompt_tokens=1000,
                    shared_tokens=int(1000 * g.hit),
                )  # fmt: skip
            )
    return Workload("sweep", groups, reqs, token_model="estimate")


def _mode(name, ttft, wan):
    phases = [
        PhaseResult("hit=0", True, [_rec(0, "hit=0", 0.1, warmup=True)], 1.0),
        PhaseResult("hit=0", False, [_rec(1, "hit=0", ttft * 2, wan=wan)], 2.0),
        PhaseResult("hit=1", True, [_rec(2, "hit=1", 0.1, warmup=True)], 1.0),
        PhaseResult("hit=1", False, [_rec(3, "hit=1", ttft, wan=wan // 10)], 1.0, not_sent=1),
    ]
    hits = {"hit=0": 0.0, "hit=1": 1.0}
    result = ModeResult(name, {"gpu_a": 1}, 2.0, url="http://x/v1")
    result.workloads["sweep"] = WorkloadResult.build("sweep", phases, hits, SLA, 2.0)
    return result


def test_report_files_from_synthetic_results(tmp_path):
    cfg = BenchConfig()
    modes = [
        _mode("colocated", 0.4, 0),
        _mode("pdd", 0.3, 50_000),
        ModeResult("pd_wan", {}, 0.0, error="`pdd serve` exited\n  details"),
    ]
    files = write_report(tmp_path, cfg, {"sweep": _sweep_workload()}, modes, {"started": "now"})
    assert sorted(p.name for p in files) == sorted(
        ["results.json", "requests.jsonl", "report.md", "ttft_cdf.png", "bathtub.png",
         "wan_bytes.png"]
    )  # fmt: skip
    for png in ("ttft_cdf.png", "bathtub.png", "wan_bytes.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG

    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"] == {"started": "now"}
    assert data["workloads"]["sweep"]["measured"] == 2
    assert data["workloads"]["sweep"]["target_hit_mean"] == 0.5
    pdd = data["modes"]["pdd"]["workloads"]["sweep"]
    assert pdd["summary"]["requests"] == 2 and pdd["summary"]["not_sent"] == 1
    assert pdd["summary"]["wall_s"] == 3.0
    assert pdd["summary"]["wan_bytes_total"] == 55_000
    assert pdd["summary"]["goodput_rps"] == 2 / 3  # both within SLA, over 2 s + 1 s
    assert pdd["summary"]["bcr"] == 1 / 3
    assert pdd["groups"]["hit=1"]["hit"] == 1.0
    assert pdd["groups"]["hit=1"]["goodput_rps"] == 1.0
    assert pdd["groups"]["hit=0"]["ttft_p50_s"] == 0.6
    assert data["modes"]["pd_wan"]["error"] == "`pdd serve` exited\n  details"

    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 8
    first = json.loads(lines[0])
    assert (first["mode"], first["workload"], first["warmup"]) == ("colocated", "sweep", True)

    md = (tmp_path / "report.md").read_text()
    assert "**Mode pd_wan did not run:** `pdd serve` exited" in md
    assert (
        "| pdd | 2/2 (+1 not sent) | 0 | 450 / 570 / 597 | - / - | 50 / 50 | 100 | 100 | 650 / 797 "
        "| 0.667 | 100.0% | 27.5 KB | 55.0 KB | - | 50.0% | 0.0% | 0.0% | none 2 | none 2 | 2 | 0.333 |"
    ) in md
    assert "| hit=1 | 1 / 0.5 / 400 / - / 50.0% | 1 / 0.5 / 300 / - / 50.0% |" in md


def test_no_bathtub_without_hit_buckets(tmp_path):
    phases = [PhaseResult("agentic", False, [_rec(0, "agentic", 0.2)], 1.0)]
    result = ModeResult("colocated", {"gpu_a": 1}, 2.0)
    result.workloads["agentic"] = WorkloadResult.build(
        "agentic", phases, {"agentic": None}, SLA, 2.0
    )
    wl = Workload("agentic", [Group("agentic")], [])
    wl.requests.append(
        BenchRequest(
            0, "agentic", False, "c0", 5, (("user", "x"),), prompt_tokens=10, shared_tokens=9
        )  # fmt: skip
    )
    files = write_report(tmp_path, BenchConfig(), {"agentic": wl}, [result], {})
    assert [p.name for p in files] == [
        "results.json", "requests.jsonl", "report.md", "ttft_cdf.png", "wan_bytes.png",
    ]  # fmt: skip
