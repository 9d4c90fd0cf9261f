"""The planner's validation against a bench run (``pdd plan-validate``): the trace it
replays carries what was asked and when it was scheduled, never how fast the lab served it, and
every mode of the run gets its own fleet. The run here is a small hand-written results folder;
the real one (a lab run) is in docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.plan import validate as plan_validate
from pdd.plan.workload import load_trace
from pdd.protocol import Role, RouterMode
from tests.plan.conftest import PROFILES

MODES = [
    {"name": "colocated", "config": "configs/colocated.yaml"},
    {"name": "pd_wan", "config": "configs/lab.yaml", "overrides": ["router.mode=pd_wan"]},
    {"name": "pdd", "config": "configs/lab.yaml", "overrides": []},
]


def _record(index: int, conv: str, prompt: int, mode: str, *, after: int | None = None,
            shared: int = 0, scheduled: float | None = None, sent: float = 0.0) -> dict:  # fmt: skip
    return {"index": index, "group": "agentic", "warmup": scheduled is None,
            "conversation": conv, "target_hit": shared / prompt, "shared_tokens": shared,
            "expected_prompt_tokens": prompt - 20, "after": after, "prompt_tokens": prompt,
            "output_tokens": 32, "scheduled_s": scheduled, "sent_s": sent, "e2e_s": 4.0,
            "ttft_s": 0.5, "status": 200, "mode": mode}  # fmt: skip


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    recs = []
    for m in MODES:
        recs += [
            _record(0, "c0", 1000, m["name"]),
            _record(1, "c1", 1200, m["name"], sent=1.0),
            _record(2, "c0", 1100, m["name"], after=0, shared=980, scheduled=2.0, sent=2.5),
            # a branch: c2 starts from the first 480 (bench-counted) tokens of c1's prompt
            _record(3, "c2", 1520, m["name"], after=1, shared=480, scheduled=3.0),
            _record(4, "c1", 1300, m["name"], after=1, shared=1180, scheduled=7.5),
        ]
    recs[-1] = {**recs[-1], "status": 429, "prompt_tokens": 0, "output_tokens": 0}
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {"requests": 3, "ttft_p50_s": 0.5, "ttft_p90_s": 1.0, "tpot_p50_s": 0.1,
               "goodput_rps": 0.2, "sla_attainment": 1.0, "wan_bytes_total": 1e6,
               "link_bytes_total": 1.1e6, "rld_token_share": 0.0, "pipelines": {}}  # fmt: skip
    results = {
        "config": {"seed": 3, "load": {"rate": 0.5}, "sla": {"ttft_s": 2.0, "tpot_s": 0.1},
                   "modes": MODES},
        "modes": {m["name"]: {"workloads": {"agentic": {"summary": summary}}} for m in MODES},
    }  # fmt: skip
    (run / "results.json").write_text(json.dumps(results))
    return run


def test_the_trace_is_what_was_asked_at_the_scheduled_times(tmp_path: Path) -> None:
    recs = [json.loads(x) for x in (_run(tmp_path) / "requests.jsonl").read_text().splitlines()]
    tokens = plan_validate.asked(recs)
    lines = plan_validate.mode_trace([r for r in recs if r["mode"] == "pdd"], "agentic", tokens)
    # warm-up when it was sent (closed loop); measured when scheduled, after the warm-up's
    # wall (5 s), not when sent (request 2 was sent late: how the lab served, not what it was asked)
    assert [x["timestamp"] for x in lines] == [0, 1, 7, 8, 12.5]
    assert [x["measured"] for x in lines] == [False, False, True, True, True]
    # a turn shares its conversation's previous prompt (server-counted), not the answer
    assert lines[2]["prefix_tokens"] == 1000 and "prefix_of" not in lines[2]
    # a branch: the shared tokens rescaled to the server's count, from the other conversation
    assert (lines[3]["prefix_tokens"], lines[3]["prefix_of"]) == (round(480 * 1520 / 1500), "c1")
    # request 4 failed here (429): still what was asked, with another mode's token counts
    assert lines[4]["prompt_tokens"] == 1300 and lines[4]["prefix_tokens"] == 1200


def test_a_run_without_the_schedule_is_refused(tmp_path: Path) -> None:
    rec = _record(0, "c0", 1000, "pdd")
    del rec["scheduled_s"]
    with pytest.raises(plan_validate.ConfigError, match="no scheduled_s / after"):
        plan_validate.mode_trace([rec], "agentic")


def test_every_mode_runs_its_own_fleet_and_gets_a_row(tmp_path: Path) -> None:
    profiles = plan_validate.load_profiles(PROFILES)
    chips = plan_validate.parse_chips("C=A,P=A,RLD=A,MD=B")
    fleet, _ = plan_validate.mode_fleet(MODES[1], chips)
    assert fleet.mode is RouterMode.PD_WAN
    assert {(g.role, g.chip, g.count) for g in fleet.groups} == {
        (Role.PREFILL, "A", 1), (Role.MAIN_DECODE, "B", 1)}  # fmt: skip
    out = tmp_path / "out"
    report = plan_validate.validate(_run(tmp_path), profiles, chips,
                                    plan_validate.parse_wan("100Mbps,20ms"), 32e9, out)  # fmt: skip
    assert list(report["modes"]) == ["colocated", "pd_wan", "pdd"]
    for name, row in report["modes"].items():
        assert row["simulated"]["measured"] == 3, name  # the warm-up is not measured
        assert row["simulated"]["ttft_p50_s"] > 0
        assert len(load_trace(out / f"trace-{name}.jsonl").conversations) == 3
    assert report["modes"]["colocated"]["simulated"]["wan_bytes"] == 0
    assert report["modes"]["pd_wan"]["simulated"]["wan_bytes"] > 0
    assert "| pdd |" in (out / "validate.md").read_text()


def test_bad_arguments_are_named(tmp_path: Path, capsys) -> None:
    base = ["--run", str(_run(tmp_path)), "--profiles", *map(str, PROFILES),
            "--wan", "100Mbps,20ms", "--out", str(tmp_path / "o")]  # fmt: skip
    assert plan_validate.main([*base, "--chips", "X=A"]) == 2
    assert "--chips: 'X=A' is not ROLE=CHIP" in capsys.readouterr().err
    assert plan_validate.main([*base, "--chips", "C=A,P=A,RLD=A,MD=Z"]) == 2
    assert "no profile named ['Z']" in capsys.readouterr().err
    assert plan_validate.main([*base, "--chips", "C=A,P=A,MD=B"]) == 2  # pdd needs an RLD chip
    assert "no chip for ['relay_decode'] (mode pdd)" in capsys.readouterr().err
