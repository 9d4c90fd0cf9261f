"""The seeds' workload over 30,000 requests at an equal P count (9 P:A): does pdd's pipeline
make P work harder, or the decoder count? Prints attainment, P's queue and busy time, and the
tokens P prefills per request (what its prefix cache missed).

    .venv/bin/python docs/results/plan/seeds-25g-30k/equal_p.py
"""

from collections import Counter
from pathlib import Path

from pdd.plan.fleet import Fleet, Group
from pdd.plan.profile import load_profiles
from pdd.plan.sim import SimSettings, Simulation, Wan
from pdd.plan.stats import Sla
from pdd.plan.workload import AgenticWorkload, agentic
from pdd.protocol import Role, RouterMode

_prefill_stage = Simulation.prefill_stage
missed: dict[int, Counter] = {}


def counted_prefill(self, p, conv, turn, rec):  # noqa: ANN001, ANN201
    c = missed.setdefault(id(self), Counter())
    c["requests"] += 1
    c["new_tokens"] += turn.prompt_tokens - p.cache.cached_tokens(conv, turn.prompt_tokens)
    return (yield from _prefill_stage(self, p, conv, turn, rec))


Simulation.prefill_stage = counted_prefill


def main() -> None:
    profiles = load_profiles([Path("configs/profiles/chip-a.yaml"),
                              Path("configs/profiles/chip-b.yaml")])  # fmt: skip
    work = agentic(AgenticWorkload(requests=30000, rate=4, context_tokens=65536, hit_rate=0.9,
                                   output_tokens=1024, seed=1))  # fmt: skip
    P, RLD, MD = Role.PREFILL, Role.RELAY_DECODE, Role.MAIN_DECODE
    fleets = [
        Fleet(RouterMode.PDD, (Group(P, "A", 9), Group(RLD, "A", 1), Group(MD, "B", 5))),
        Fleet(RouterMode.PDD, (Group(P, "A", 9), Group(RLD, "A", 1), Group(MD, "B", 8))),
        Fleet(RouterMode.PD_LOCAL, (Group(P, "A", 9), Group(MD, "B", 5))),
        Fleet(RouterMode.PD_LOCAL, (Group(P, "A", 9), Group(MD, "B", 8))),
    ]
    for fleet in fleets:
        sim = Simulation(fleet, profiles, Wan(25e9, 0.04), work, Sla(5, 0.05, 0.9), SimSettings())
        res = sim.run()
        c = missed[id(sim)]
        busy = sum(w.prefill_busy_s for w in sim.workers.values() if w.role is P)
        print(f"{fleet.mode.value:8} {res.fleet:28} attainment {res.attainment:.2f}  "
              f"P queue P90 {res.p_wait_p90_s:6.2f} s  P busy {busy:7.0f} s  "
              f"P prefills {c['new_tokens'] / c['requests']:6.0f} tokens/request", flush=True)


if __name__ == "__main__":
    main()
