"""The fleet search, and `pdd plan`'s answers to bad input and to SLAs no fleet can meet."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdd.config.router import PddPolicyConfig
from pdd.errors import ConfigError
from pdd.plan import cli
from pdd.plan.fleet import Fleet, Group
from pdd.plan.search import Searcher
from pdd.plan.sim import SimSettings, Wan
from pdd.plan.stats import Sla
from pdd.plan.workload import AgenticWorkload, agentic, load_trace
from pdd.protocol import Role, RouterMode
from tests.plan.conftest import PROFILES

SMALL = "agentic:requests=150,rate=1,context_tokens=16384,output_tokens=128"
WAN = Wan(10e9, 0.04)
PDD = {Role.PREFILL: "A", Role.RELAY_DECODE: "A", Role.MAIN_DECODE: "B"}


def _searcher(profiles, sla: Sla, wan: Wan = WAN) -> Searcher:
    work = agentic(AgenticWorkload(requests=150, rate=1, context_tokens=16384, output_tokens=128))
    return Searcher(profiles, wan, work, sla, SimSettings(), max_sims=30)


def test_search_finds_the_smallest_fleet_that_meets_the_sla(profiles) -> None:
    s = _searcher(profiles, Sla(5.0, 0.05))
    res = s.search(RouterMode.PDD, PDD)
    assert res.infeasible is None and res.best is not None and res.best.meets_sla
    # one fewer of any role no longer meets it (or the role is at its minimum of one)
    fleet = cli.parse_fleet("pdd:" + ",".join(
        f"{k}={v.split(':')[1]}*{v.split(' ')[0]}" for k, v in zip(
            ("P", "RLD", "MD"), res.best.fleet.split(" + "), strict=True)), profiles)  # fmt: skip
    assert fleet.label() == res.best.fleet
    for g in fleet.groups:
        if g.count > 1:
            assert not s.simulate(fleet.with_count(g.role, g.count - 1)).meets_sla, g.role


def test_an_sla_below_one_prefill_is_infeasible_and_names_prefill(profiles) -> None:
    res = _searcher(profiles, Sla(0.01, 0.05)).search(RouterMode.PDD, PDD)
    assert res.best is None and "prefill compute of chip A" in (res.infeasible or "")


def test_a_tpot_below_one_decode_step_names_the_decode_chip(profiles) -> None:
    res = _searcher(profiles, Sla(5.0, 0.001)).search(
        RouterMode.PD_LOCAL, {Role.PREFILL: "A", Role.MAIN_DECODE: "B"}
    )
    assert res.best is None and "decode step of chip B" in (res.infeasible or "")


def test_pd_wan_over_a_thin_link_names_the_wan(profiles) -> None:
    # D's DRC holds the history: the link must carry each turn's new tokens (0.3 Gbit/s here)
    res = _searcher(profiles, Sla(5.0, 0.05), Wan(0.1e9, 0.04)).search(
        RouterMode.PD_WAN, {Role.PREFILL: "A", Role.MAIN_DECODE: "A"})  # fmt: skip
    assert res.best is None and "WAN bandwidth" in (res.infeasible or "")


def test_a_fleet_grown_on_the_wrong_role_is_traded_down_to_a_cheaper_one(profiles) -> None:
    """Where more MD would have done what many Ps do (slow decoders keep more conversations
    alive than P's caches hold), the search trades: grow MD, shrink P again, while cheaper.
    A stand-in SLA over the counts: met when P + 2 x MD >= 10 (A costs 1/h, B 1.25/h)."""
    s = _searcher(profiles, Sla(5.0, 0.05))
    seen: dict = {}

    def run(f: Fleet) -> SimpleNamespace:
        seen[tuple(g.count for g in f.groups)] = True
        return SimpleNamespace(
            meets_sla=f.count(Role.PREFILL) + 2 * f.count(Role.MAIN_DECODE) >= 10
        )

    grown = Fleet(
        RouterMode.PD_LOCAL, (Group(Role.PREFILL, "A", 8), Group(Role.MAIN_DECODE, "B", 1))
    )
    best = s._trade(grown, run, seen)
    prices = {"A": 1.0, "B": 1.25}
    assert run(best).meets_sla and best.cost_per_hour(prices) < grown.cost_per_hour(prices)
    assert (best.count(Role.PREFILL), best.count(Role.MAIN_DECODE)) == (2, 4)  # 7.00/h: the least

    capped = _searcher(profiles, Sla(5.0, 0.05))
    capped.max_sims, seen = 3, {}
    assert capped._trade(grown, run, seen) == grown and len(seen) <= 3  # --max-sims holds here too


def _main(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main([*args])
    out = capsys.readouterr()
    return code, out.out, out.err


BASE = ("--profiles", *map(str, PROFILES), "--wan", "10Gbps,40ms,0.01", "--sla", "ttft=5,tpot=0.05")


def test_cli_plans_and_writes_table_json_and_plot(capsys, tmp_path: Path) -> None:
    code, out, _ = _main(capsys, *BASE, "--workload", SMALL, "--modes", "pdd",
                         "--chips", "P=A,RLD=A,MD=B", "--out", str(tmp_path))  # fmt: skip
    assert code == 0, out
    assert "| pdd | prefill=A relay_decode=A main_decode=B |" in out and "best: pdd" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["best"]["meets_sla"] and plan["candidates"][0]["chips"]["main_decode"] == "B"
    assert (tmp_path / "plan.md").exists()
    assert (tmp_path / "plan.png").stat().st_size > 1000


def test_cli_says_when_no_fleet_meets_the_sla(capsys) -> None:
    code, out, _ = _main(capsys, "--profiles", *map(str, PROFILES), "--wan", "10Gbps,40ms",
                         "--sla", "ttft=0.01,tpot=0.05", "--workload", SMALL, "--modes", "pdd",
                         "--chips", "P=A,RLD=A,MD=B")  # fmt: skip
    assert code == 1
    assert "no fleet meets the SLA: prefill compute of chip A" in out


def test_cli_one_fleet(capsys) -> None:
    code, out, _ = _main(capsys, *BASE, "--workload", SMALL, "--fleet", "pdd:P=A*2,RLD=A*1,MD=B*2")
    assert code == 0 and json.loads(out)["fleet"] == "2 P:A + 1 RLD:A + 2 MD:B"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--wan", "fast,40ms"), "--wan: bandwidth 'fast'"),
        (("--wan", "10Gbps"), "BANDWIDTH,RTT"),
        (("--sla", "ttft=5"), "--sla: missing tpot"),
        (("--sla", "ttft=5,tpot=0.05,p99=1"), "unknown key 'p99'"),
        (("--workload", "agentic:hit_rate=1.5"), "hit_rate"),
        (("--workload", "agentic:turns=2,hit_rate=0.95"), "out of reach with turns 2"),
        (
            ("--workload", "agentic:context_tokens=4096,output_tokens=1024,hit_rate=0.95"),
            "out of reach with context_tokens 4096 and output_tokens 1024",
        ),  # fmt: skip
        (("--prices", "Z=3"), "chip 'Z' has no profile"),
        (("--chips", "MD=C"), "chip 'C' has no profile"),
        (("--modes", "pdq"), "mode 'pdq'"),
        (("--fleet", "pdd:P=A*2,MD=B*2"), "needs at least one worker of each"),
        (("--policy", "ttft_budget_s=-1"), "--policy"),
    ],
)
def test_cli_bad_input_is_a_clear_error(capsys, args: tuple[str, ...], message: str) -> None:
    argv = list(BASE) + ["--workload", SMALL]
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    code, _, err = _main(capsys, *argv)
    assert code == 2 and message in err, err


def test_cli_profile_missing_a_field(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "chip-c.yaml"
    bad.write_text(PROFILES[0].read_text().replace("name: A", "name: C").replace(
        "kv_bytes_per_token: 57344", ""))  # fmt: skip
    code, _, err = _main(capsys, "--profiles", str(bad), "--wan", "10Gbps,40ms",
                         "--sla", "ttft=5,tpot=0.05")  # fmt: skip
    assert code == 2 and str(bad) in err and "missing field 'kv_bytes_per_token'" in err


def test_trace_workload(tmp_path: Path, profiles) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 10 + i, "conversation_id": f"c{i % 3}", "prompt_tokens": 4000 + 500 * i,
              "output_tokens": 64} for i in range(9)]  # fmt: skip
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    work = load_trace(trace)
    assert work.requests == 9 and len(work.conversations) == 3
    assert work.conversations[0].turns[0].at_s == 0.0
    s = Searcher(profiles, Wan(10e9, 0.04), work, Sla(5, 0.05), SimSettings())
    res = s.simulate(cli.parse_fleet("pdd:P=A*1,RLD=A*1,MD=B*1", profiles))
    assert res.requests == 9 and res.ttft_p50_s > 0


def _simulate_trace(
    path: Path, profiles, lines: list[dict], settings: SimSettings | None = None
) -> object:
    """One pdd fleet (1 P, 1 RLD, 1 MD) over the trace ``lines``, written to ``path``."""
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = Searcher(profiles, Wan(10e9, 0.04), load_trace(path), Sla(5, 0.05),
                 settings or SimSettings())  # fmt: skip
    return s.simulate(cli.parse_fleet("pdd:P=A*1,RLD=A*1,MD=B*1", profiles))


def test_a_trace_that_rewrites_history_and_marks_its_warm_up(tmp_path: Path, profiles) -> None:
    """``prefix_tokens``: a turn that shares only its previous prompt (not the answer) lands
    the answer's blocks again; ``measured: false`` lines warm the caches and are not counted.
    (MD waits for every miss here, md_recompute off, so the WAN's bytes show what it lacked.)"""
    waits = SimSettings(policy=PddPolicyConfig(md_recompute=False))

    def run(**second) -> object:
        return _simulate_trace(tmp_path / "t.jsonl", profiles, [
            {"timestamp": 0, "conversation_id": "w", "prompt_tokens": 2000, "output_tokens": 8,
             "measured": False},
            {"timestamp": 0, "conversation_id": "c", "prompt_tokens": 8000, "output_tokens": 512,
             "measured": False},
            {"timestamp": 30, "conversation_id": "c", "prompt_tokens": 8600, "output_tokens": 8,
             **second},
        ], waits)  # fmt: skip

    whole, rewritten = run(), run(prefix_tokens=8000)
    assert whole.requests == rewritten.requests == 3
    assert whole.measured == rewritten.measured == 1
    # the answer's 512 tokens (whole blocks of them) cross the WAN again
    block = profiles["B"].block_size
    gap = profiles["A"].kv_bytes_per_token * (8512 // block - 8000 // block) * block
    assert rewritten.wan_gb * 1e9 - whole.wan_gb * 1e9 == pytest.approx(gap, rel=0.01)


def test_a_trace_branch_starts_from_what_the_caches_hold_of_its_source(
    tmp_path: Path, profiles
) -> None:
    """``prefix_of``: a new conversation that starts from another one's history hits what P
    and MD hold of it; without it the same prompt is cold."""

    def run(**branch) -> object:
        return _simulate_trace(tmp_path / "t.jsonl", profiles, [
            {"timestamp": 0, "conversation_id": "c", "prompt_tokens": 8000, "output_tokens": 8,
             "measured": False},
            {"timestamp": 30, "conversation_id": "d", "prompt_tokens": 8600, "output_tokens": 8,
             **branch},
        ])  # fmt: skip

    cold, branched = run(), run(prefix_tokens=6000, prefix_of="c")
    block = profiles["B"].block_size
    saved = profiles["A"].kv_bytes_per_token * (6000 // block) * block
    assert cold.wan_gb * 1e9 - branched.wan_gb * 1e9 == pytest.approx(saved, rel=0.01)
    assert branched.ttft_p50_s < cold.ttft_p50_s  # P prefills 2,600 tokens, not 8,600
    with pytest.raises(ConfigError, match="prefix_of names no conversation of the trace: x"):
        (tmp_path / "bad.jsonl").write_text(json.dumps(
            {"timestamp": 0, "prompt_tokens": 10, "output_tokens": 2, "prefix_tokens": 5,
             "prefix_of": "x"}) + "\n")  # fmt: skip
        load_trace(tmp_path / "bad.jsonl")


def test_bad_trace_lines_are_listed(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 1, "prompt_tokens": 10, "output_tokens": 2}\nnot json\n'
                     '{"timestamp": 2, "prompt_tokens": -1, "output_tokens": 2}\n')  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_trace(trace)
    assert "line 2: not JSON" in str(err.value) and "line 3: prompt_tokens" in str(err.value)


def test_cli_bathtub_writes_a_point_per_hit_rate(capsys, tmp_path: Path) -> None:
    code, out, _ = _main(capsys, *BASE, "--workload", SMALL, "--modes", "pdd",
                         "--chips", "P=A,RLD=A,MD=B", "--bathtub", "0,0.8",
                         "--out", str(tmp_path))  # fmt: skip
    assert code == 0, out
    points = json.loads((tmp_path / "bathtub.json").read_text())["points"]
    assert [p["hit_rate"] for p in points] == [0.0, 0.8]
    assert all(p["bcr"] and p["fleet"] for p in points)
    assert (tmp_path / "bathtub.png").exists() and "| 0.80 | pdd" in out
