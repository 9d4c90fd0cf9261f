"""Seeded small runs whose figures are pinned (``data/sim_golden.json``).

The figures were written by the simulator as it was before the issue-20 speedup (commit
78cb16e: a simpy process per conversation, a generator per request, per-sequence decode
arithmetic); ``test_plan_golden.py`` checks the optimised simulator gives the same ones.
Regenerate only for a deliberate model change: ``python -m tests.plan.sim_cases``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdd.config.router import PddPolicyConfig
from pdd.plan.fleet import Fleet, Group
from pdd.plan.profile import load_profiles
from pdd.plan.sim import SimSettings, Simulation, Wan
from pdd.plan.stats import Sla
from pdd.plan.workload import AgenticWorkload, Conversation, Turn, Workload, agentic
from pdd.protocol import Role, RouterMode

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "data" / "sim_golden.json"
SKIP = ("sim_wall_s", "sim_cpu_s", "events")  # how the run went, not what it found
P, RLD, MD, C = Role.PREFILL, Role.RELAY_DECODE, Role.MAIN_DECODE, Role.COLOCATED


def _work(**kw) -> Workload:
    base = {"requests": 300, "rate": 1.5, "context_tokens": 16384, "output_tokens": 128, "seed": 3}
    return agentic(AgenticWorkload(**{**base, **kw}))


def _trace() -> Workload:
    convs = tuple(
        Conversation(c, 2.0 * c, tuple(Turn(3000 + 900 * k + 37 * c, 40 + 9 * k, 2.0 * c + 1.5 * k)
                                       for k in range(6)))
        for c in range(12)
    )  # fmt: skip
    return Workload("trace(cases)", convs)


def _fleet(mode: RouterMode, *groups: tuple[Role, str, int]) -> Fleet:
    return Fleet(mode, tuple(Group(r, chip, n) for r, chip, n in groups))


def cases() -> dict[str, tuple[Fleet, Wan, Workload, SimSettings]]:
    pdd = _fleet(RouterMode.PDD, (P, "A", 2), (RLD, "A", 1), (MD, "B", 2))
    tight = SimSettings(policy=PddPolicyConfig(ttft_budget_s=0.001))
    return {
        "pdd": (pdd, Wan(10e9, 0.04, 0.01), _work(), SimSettings()),
        "pdd_loaded": (_fleet(RouterMode.PDD, (P, "A", 1), (RLD, "A", 1), (MD, "B", 1)),
                       Wan(10e9, 0.04), _work(rate=6.0, output_tokens=256, context_tokens=32768),
                       SimSettings()),
        "pdd_relay": (_fleet(RouterMode.PDD, (P, "A", 2), (RLD, "A", 2), (MD, "B", 2)),
                      Wan(10e9, 0.04), _work(hit_rate=0.5, output_tokens=768), tight),
        "pdd_one_shot": (pdd, Wan(10e9, 0.04), _work(hit_rate=0.5, rate=3.0, output_tokens=768),
                         SimSettings(policy=PddPolicyConfig(ttft_budget_s=0.001,
                                                            catch_up_load_threshold=0.0))),
        "pdd_rld_finished": (_fleet(RouterMode.PDD, (P, "A", 1), (RLD, "A", 2), (MD, "B", 1)),
                             Wan(0.2e9, 0.04),
                             _work(requests=60, hit_rate=0.0, output_tokens=8,
                                   context_tokens=32768, rate=0.5),
                             SimSettings(policy=PddPolicyConfig(ttft_budget_s=0.01))),
        "pdd_busy_md": (_fleet(RouterMode.PDD, (P, "A", 2), (RLD, "A", 1), (MD, "A", 1)),
                        Wan(10e9, 0.04), _work(rate=6.0, output_tokens=1024),
                        SimSettings()),
        "pdd_exact_cache": (pdd, Wan(10e9, 0.04), _work(requests=120), SimSettings(exact_cache=True)),
        "pdd_trace": (pdd, Wan(10e9, 0.04), _trace(), SimSettings()),
        "pd_wan": (_fleet(RouterMode.PD_WAN, (P, "A", 2), (MD, "A", 2)), Wan(25e9, 0.04),
                   _work(), SimSettings()),
        "pd_local": (_fleet(RouterMode.PD_LOCAL, (P, "A", 2), (MD, "B", 2)), Wan(10e9, 0.04),
                     _work(), SimSettings(baseline_affinity=False)),
        "colocated": (_fleet(RouterMode.COLOCATED, (C, "A", 3)), Wan(10e9, 0.04), _work(),
                      SimSettings()),
    }  # fmt: skip


def run_case(name: str) -> dict:
    profiles = load_profiles([ROOT / "configs/profiles/chip-a.yaml",
                              ROOT / "configs/profiles/chip-b.yaml"])  # fmt: skip
    fleet, wan, work, settings = cases()[name]
    sim = Simulation(fleet, profiles, wan, work, Sla(2.0, 0.03), settings)
    res = sim.run().to_dict()
    out = {k: v for k, v in res.items() if k not in SKIP}
    log = sim.log
    out["log"] = {"n": len(log.arrival), "ttft_sum": sum(log.ttft), "e2e_sum": sum(log.e2e),
                  "wan_sum": sum(log.wan), "rld_sum": sum(log.rld),
                  "p_wait_sum": sum(log.p_wait)}  # fmt: skip
    return out


if __name__ == "__main__":
    GOLDEN.write_text(
        json.dumps({n: run_case(n) for n in cases()}, indent=1, sort_keys=True) + "\n"
    )
    print(f"wrote {GOLDEN}")
