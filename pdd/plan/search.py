"""Fleet search: the instance counts per role (for given chips) with the highest BCR meeting
the SLA, and, when none does, which resource binds.

For one mode and one chip per role:

  1. Bounds no fleet size can move (``bounds``): the share of requests whose TTFT or TPOT is
     over the limit even on an idle instance with a perfect prefix cache (prefill of the turn's
     new tokens, one decode step at batch 1), and the WAN the mode needs (pd_wan and pdd: at
     least the blocks no decoder's cache can hold, the new tokens) against its bandwidth.
     Over the SLA's allowance: infeasible, that resource named.
  2. Grow: from one instance per role, simulate; while the SLA is missed, simulate each role
     grown by half and keep the growth that gains the most attainment per unit of added
     cost; when none gains, the role that likely binds (the most loaded of the roles on the
     failing metric: TTFT -> P (pd: P or D), TPOT -> MD or RLD (RLD when p_rld_md was due but
     no RLD had a slot)); a role whose growth did not help twice in a row (attainment,
     median TTFT or TPOT) is set aside for the next one; when every role is set aside, no
     fleet is found.
  3. Shrink: for each role, the fewest instances that still meet the SLA (bisection).
  4. Trade: grow one role by half and shrink the others again; keep it when the met fleet
     costs less, and repeat (the growth may have spent on the wrong role).
Fewer instances at the same goodput is a higher BCR: the answer is the met fleet after 4.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.plan.fleet import ROLES, SHORT, Fleet, Group
from pdd.plan.profile import ChipProfile
from pdd.plan.sim import SimResult, SimSettings, Simulation, Wan
from pdd.plan.stats import Sla
from pdd.plan.workload import Workload
from pdd.protocol import Role, RouterMode


@dataclass
class SearchResult:
    mode: RouterMode
    chips: dict[Role, str]
    best: SimResult | None
    infeasible: str | None = None  # why no fleet meets the SLA (the binding resource)
    tried: list[SimResult] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.mode.value} " + ",".join(f"{SHORT[r]}:{c}" for r, c in self.chips.items())


def bounds(mode: RouterMode, chips: dict[Role, str], profiles: dict[str, ChipProfile],
           wan: Wan, workload: Workload, sla: Sla) -> str | None:  # fmt: skip
    """Why no fleet of these chips can meet ``sla`` (None: a large enough one might)."""
    pre = profiles[chips[Role.COLOCATED if mode is RouterMode.COLOCATED else Role.PREFILL]]
    dec = profiles[chips[Role.COLOCATED if mode is RouterMode.COLOCATED else Role.MAIN_DECODE]]
    slow_ttft = slow_tpot = total = 0
    need_bits = 0.0
    span = 0.0
    for conv in workload.conversations:
        prev = 0
        for turn in conv.turns:
            total += 1
            n = turn.prompt_tokens
            cached = min(prev, n) // pre.block_size * pre.block_size
            slow_ttft += pre.prefill_s(n - cached, cached) > sla.ttft_s
            slow_tpot += dec.decode_step_s(1, n) > sla.tpot_s
            new = max(0, n - prev - turn.output_tokens)  # what no decoder's cache can hold
            if mode in (RouterMode.PD_WAN, RouterMode.PDD):
                need_bits += new * dec.kv_bytes_per_token * 8
            prev = n + turn.output_tokens
            span = max(span, turn.at_s or 0.0)
    allowed = (1 - sla.attainment) * total
    if slow_ttft > allowed:
        return (f"prefill compute of chip {pre.name}: {slow_ttft} of {total} requests take "
                f"longer than ttft={sla.ttft_s}s to prefill on an idle instance")  # fmt: skip
    if slow_tpot > allowed:
        return (f"decode step of chip {dec.name}: {slow_tpot} of {total} requests need more "
                f"than tpot={sla.tpot_s}s per token at batch 1")  # fmt: skip
    rate = _offered_rate(workload)
    if rate and need_bits and mode is RouterMode.PD_WAN:
        gbps = need_bits / total * rate / 1e9
        if gbps > wan.bandwidth_bps / 1e9:
            return (f"WAN bandwidth: pd_wan needs {gbps:.1f} Gbit/s of KV at "
                    f"{rate:.2f} req/s, the link has {wan.bandwidth_bps / 1e9:.1f}")  # fmt: skip
    return None


def _offered_rate(workload: Workload) -> float:
    starts = [c.start_s for c in workload.conversations]
    if len(starts) < 2 or max(starts) <= 0:
        return 0.0
    per_conv = workload.requests / len(starts)
    return (len(starts) - 1) / max(starts) * per_conv


class Searcher:
    def __init__(self, profiles: dict[str, ChipProfile], wan: Wan, workload: Workload,
                 sla: Sla, settings: SimSettings, max_instances: int = 512,
                 max_sims: int = 150, prices: dict[str, float] | None = None) -> None:  # fmt: skip
        self.profiles, self.wan, self.workload, self.sla = profiles, wan, workload, sla
        self.settings, self.max_instances, self.max_sims = settings, max_instances, max_sims
        self.prices = prices or {}

    def simulate(self, fleet: Fleet) -> SimResult:
        sim = Simulation(fleet, self.profiles, self.wan, self.workload, self.sla, self.settings)
        sim.prices.update(self.prices)
        return sim.run()

    def search(self, mode: RouterMode, chips: dict[Role, str]) -> SearchResult:
        out = SearchResult(mode, chips, None)
        why = bounds(mode, chips, self.profiles, self.wan, self.workload, self.sla)
        if why:
            out.infeasible = why
            return out
        seen: dict[tuple[int, ...], SimResult] = {}

        def run(f: Fleet) -> SimResult:
            if f.counts not in seen:
                seen[f.counts] = self.simulate(f)
                out.tried.append(seen[f.counts])
            return seen[f.counts]

        fleet = Fleet(mode, tuple(Group(r, chips[r], 1) for r in ROLES[mode]))
        res = run(fleet)
        best_att, stale, stuck = res.attainment, 0, set()
        while not res.meets_sla:
            order = binding_roles(mode, res)
            if order is None:
                out.infeasible = (f"WAN bandwidth ({self.wan.bandwidth_bps / 1e9:g} Gbit/s, "
                                  f"{res.wan_utilisation:.0%} busy) at {res.fleet}")  # fmt: skip
                return out
            live = [r for r in order if r not in stuck]
            total = sum(fleet.counts)
            if not live:
                out.infeasible = (f"growing any role stopped helping: attainment stuck at "
                                  f"{best_att:.0%} (TTFT over the limit {res.fail_ttft:.0%}, "
                                  f"TPOT {res.fail_tpot:.0%}); binds: {order[0].value} "
                                  f"at {res.fleet}")  # fmt: skip
                return out
            if total >= self.max_instances or len(seen) >= self.max_sims:
                out.infeasible = (f"not met within {self.max_instances} instances / "
                                  f"{self.max_sims} runs; binds: {live[0].value} "
                                  f"(at {res.fleet}: attainment {res.attainment:.0%})")  # fmt: skip
                return out
            grown = {r: self._grow(fleet, r) for r in live}
            role = self._steepest(fleet, res, grown, {r: run(f) for r, f in grown.items()}, live)
            fleet = grown[role]
            prev, res = res, run(fleet)
            if _progress(prev, res):
                stale, stuck = 0, set()
            else:  # two growths of one role without progress: grow the next role instead
                stale += 1
                if stale >= 2:
                    stuck.add(role)
                    stale = 0
            best_att = max(best_att, res.attainment)
        fleet = self._shrink(fleet, list(ROLES[mode]), run, seen)
        out.best = run(self._trade(fleet, run, seen))
        return out

    def _shrink(self, fleet: Fleet, roles: list[Role], run: Callable[[Fleet], SimResult],
                seen: dict[tuple[int, ...], SimResult]) -> Fleet:  # fmt: skip
        """Each role (the dearest first) cut to the fewest instances that still meet the SLA
        (bisection; ``fleet`` meets it)."""
        for role in sorted(roles, key=lambda r: -self._price(fleet, r)):
            lo, hi = 1, fleet.count(role)  # hi meets
            while lo < hi and len(seen) < self.max_sims:
                mid = (lo + hi) // 2
                if run(fleet.with_count(role, mid)).meets_sla:
                    hi = mid
                else:
                    lo = mid + 1
            fleet = fleet.with_count(role, hi)
        return fleet

    def _trade(self, fleet: Fleet, run: Callable[[Fleet], SimResult],
               seen: dict[tuple[int, ...], SimResult]) -> Fleet:  # fmt: skip
        """Trade instances between roles while that makes the met fleet cheaper: grow one role
        by half, shrink the others again; keep the first trade that costs less, and repeat.
        The growth phase can spend on the wrong role (its guess of what binds), and the shrink
        keeps every instance another role's shortfall needs."""
        prices = self._prices()
        roles = [g.role for g in fleet.groups]
        traded = True
        while traded and len(seen) < self.max_sims:
            traded = False
            for up in roles:
                more = self._grow(fleet, up)
                fresh = more.counts not in seen
                if more == fleet or (fresh and len(seen) >= self.max_sims):
                    continue
                if not run(more).meets_sla:
                    continue
                cand = self._shrink(more, [r for r in roles if r is not up], run, seen)
                cand = self._shrink(cand, [up], run, seen)
                if cand.cost_per_hour(prices) < fleet.cost_per_hour(prices) - 1e-9:
                    fleet, traded = cand, True
                    break
        return fleet

    def _grow(self, fleet: Fleet, role: Role) -> Fleet:
        """``role`` grown by half (at least one), within ``max_instances``."""
        n, total = fleet.count(role), sum(fleet.counts)
        return fleet.with_count(role, min(max(n + 1, math.ceil(n * 1.5)),
                                          n + self.max_instances - total))  # fmt: skip

    def _steepest(self, fleet: Fleet, res: SimResult, grown: dict[Role, Fleet],
                  results: dict[Role, SimResult], order: list[Role]) -> Role:  # fmt: skip
        """The growth that gains the most attainment per unit of added cost; the likeliest
        binding role (``order[0]``) when none gains. The binding role is a guess from the
        failing metric, and it can be wrong: slow decoders lengthen every conversation, so
        more of them live at once, P's prefix caches overflow and TTFT fails, which more Ps
        only feed (measured: a pdd fleet grown to 12 P + 9 RLD where 9 P + 8 MD met it)."""
        prices = self._prices()
        cost = fleet.cost_per_hour(prices)

        def gain(r: Role) -> float:
            added = grown[r].cost_per_hour(prices) - cost
            return (results[r].attainment - res.attainment) / max(added, 1e-9)

        best = max(order, key=lambda r: (gain(r), -order.index(r)))
        return best if results[best].attainment > res.attainment + 0.005 else order[0]

    def _prices(self) -> dict[str, float]:
        return {name: self.prices.get(name, p.price_per_hour) for name, p in self.profiles.items()}

    def _price(self, fleet: Fleet, role: Role) -> float:
        chip = next(g.chip for g in fleet.groups if g.role is role)
        return self._prices()[chip] * fleet.count(role)


def _progress(before: SimResult, after: SimResult) -> bool:
    """Growing helped: more requests met the SLA, or the median TTFT or TPOT fell by 10%."""
    return (after.attainment > before.attainment + 0.005
            or after.ttft_p50_s < 0.9 * before.ttft_p50_s
            or after.tpot_p50_s < 0.9 * before.tpot_p50_s)  # fmt: skip


def binding_roles(mode: RouterMode, res: SimResult) -> list[Role] | None:
    """The roles to grow for a missed SLA, the likeliest first (the most loaded of those on
    the failing metric, then the rest by load); None when the WAN is what binds."""
    util = res.utilisation
    roles = list(ROLES[mode])
    first: list[Role]
    if mode is RouterMode.COLOCATED:
        return [Role.COLOCATED]
    if res.fail_ttft >= res.fail_tpot:
        if mode is RouterMode.PD_WAN and res.wan_utilisation > 0.9:
            return None
        first = [Role.PREFILL] + ([Role.MAIN_DECODE] if mode is not RouterMode.PDD else [])
    else:
        if res.wan_utilisation > 0.95 and util.get("main_decode", 0) < 0.9:
            return None
        first = [Role.MAIN_DECODE]
        if mode is RouterMode.PDD and res.rld_starved > 0.02:
            first = [Role.RELAY_DECODE, Role.MAIN_DECODE]
    by_load = sorted(roles, key=lambda r: -util.get(r.value, 0.0))
    head = sorted(first, key=lambda r: -util.get(r.value, 0.0)) if len(first) > 1 else first
    if mode is RouterMode.PDD and first[0] is Role.RELAY_DECODE:
        head = first
    return head + [r for r in by_load if r not in head]
