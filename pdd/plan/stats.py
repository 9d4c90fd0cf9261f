"""What a run measured: per-request log, SLA, and the summary a plan row is made of.

Definitions are pdd's (DESIGN.md, pdd.bench.serve.metrics): TTFT = arrival -> first token;
TPOT = (E2E - TTFT) / (output tokens - 1) (a one-token answer meets any TPOT); a request is
good when TTFT <= sla.ttft_s and TPOT <= sla.tpot_s; SLA goodput = good requests per second of
the measured window; BCR = goodput / cost per hour. The measured window is the steady state
(``measure_window``): requests that arrived after conversations had time to overlap and
before the last conversation started (caches filled, queues settled, load not yet draining).
A trace that marks warm-up requests (``measured: false``) is measured as ``pdd bench serve``
measures it: its measured requests, from the first one's arrival to the last one's end. A
fleet *meets* the SLA when at least ``sla.attainment`` of the measured requests are good.
Cost per hour = the chips' prices + the WAN's price per GB x the GB it carried per hour.
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pdd.errors import ConfigError

if TYPE_CHECKING:
    from pdd.plan.sim import Simulation


@dataclass(frozen=True, slots=True)
class Sla:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    @staticmethod
    def parse(text: str) -> Sla:
        """``ttft=5,tpot=0.05[,attainment=0.9]`` (seconds)."""
        fields: dict[str, float] = {}
        for part in filter(None, text.split(",")):
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in ("ttft", "tpot", "attainment"):
                raise ConfigError(f"--sla: unknown key {key!r} (ttft, tpot, attainment)")
            try:
                fields[key] = float(value.strip().removesuffix("s"))
            except ValueError:
                raise ConfigError(f"--sla: {key}={value!r} is not a number") from None
        missing = [k for k in ("ttft", "tpot") if k not in fields]
        if missing:
            raise ConfigError(f"--sla: missing {', '.join(missing)} (e.g. ttft=5,tpot=0.05)")
        if fields["ttft"] <= 0 or fields["tpot"] <= 0:
            raise ConfigError("--sla: ttft and tpot must be positive")
        att = fields.get("attainment", 0.9)
        if not 0 < att <= 1:
            raise ConfigError("--sla: attainment must be in (0, 1]")
        return Sla(fields["ttft"], fields["tpot"], att)


PIPES = ("colocated", "pd", "p_md", "p_rld_md", "unavailable")
HANDOFFS = ("none", "one_shot", "catch_up", "rld_finished")
_PIPE = {p: i for i, p in enumerate(PIPES)}
_HANDOFF = {h: i for i, h in enumerate(HANDOFFS)}


class RequestLog:
    """Columns of per-request numbers (arrays: a million requests stay small)."""

    def __init__(self) -> None:
        self.arrival, self.ttft, self.e2e = array("d"), array("d"), array("d")
        self.out, self.rld, self.pipe, self.handoff = (array("l") for _ in range(4))
        self.wan, self.p_wait = array("d"), array("d")
        self.warmup: list[int] = []  # indices of warm-up requests (traces that mark them)

    def add(self, arrival: float, first: float | None, end: float | None, out: int,
            pipeline: str, rld: int = 0, wan: int = 0, handoff: str = "none",
            p_wait: float = 0.0, measured: bool = True) -> int:  # fmt: skip
        """Log one request; returns its row."""
        if not measured:
            self.warmup.append(len(self.arrival))
        self.arrival.append(arrival)
        self.ttft.append(-1.0 if first is None else first - arrival)
        self.e2e.append(-1.0 if end is None else end - arrival)
        self.out.append(out)
        self.rld.append(rld)
        self.pipe.append(_PIPE[pipeline])
        self.handoff.append(_HANDOFF[handoff])
        self.wan.append(wan)
        self.p_wait.append(p_wait)
        return len(self.arrival) - 1


@dataclass(frozen=True)
class SimResult:
    fleet: str
    mode: str
    chips: dict[str, int]
    requests: int
    measured: int
    window_s: float
    goodput_rps: float
    attainment: float
    meets_sla: bool
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    hardware_cost_per_hour: float
    wan_cost_per_hour: float
    cost_per_hour: float
    bcr: float
    cost_per_mtok: float | None
    rld_token_share: float
    pipelines: dict[str, int]
    handoffs: dict[str, int]
    wan_utilisation: float
    wan_gb: float
    utilisation: dict[str, float]  # per role: P busy fraction; decoders' mean occupancy
    fail_ttft: float  # fraction of measured requests over the TTFT limit
    fail_tpot: float
    rld_starved: float  # fraction of requests the policy wanted on RLD but none had a slot
    p_wait_p90_s: float
    sim_wall_s: float
    sim_cpu_s: float  # CPU time of the run (wall time on a shared machine varies with load)
    events: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measure_window(sim: Simulation) -> tuple[float, float]:
    """The steady state: from when conversations have had time to overlap (the mean
    conversation's span, at most half-way) to the start of the last conversation (later,
    load only drains). Falls back to the whole arrival span for one-turn traces."""
    convs = sim.workload.conversations
    last_start = max((c.start_s for c in convs), default=0.0)
    spans = sim.conversation_spans
    ramp = sum(spans) / len(spans) if spans else 0.0
    last = max(sim.log.arrival) if sim.log.arrival else 0.0
    if last_start <= 0 or last_start < 0.2 * last:
        return last * sim.settings.warmup_fraction, last
    return min(max(ramp, last_start * sim.settings.warmup_fraction), last_start / 2), last_start


def measured_requests(sim: Simulation) -> tuple[list[int], float]:
    """The measured requests (indices into the log) and the window's length in seconds."""
    log = sim.log
    if log.warmup:
        warm = set(log.warmup)
        idx = [i for i in range(len(log.arrival)) if i not in warm]
        if not idx:
            return [], 1e-9
        ends = [log.arrival[i] + log.e2e[i] for i in idx if log.e2e[i] >= 0]
        start = min(log.arrival[i] for i in idx)
        return idx, max(max(ends, default=start) - start, 1e-9)
    start, last = measure_window(sim)
    return [i for i, a in enumerate(log.arrival) if start <= a <= last], max(last - start, 1e-9)


def summarize(sim: Simulation, wall_s: float, cpu_s: float = 0.0) -> SimResult:
    log, sla, env = sim.log, sim.sla, sim.env
    idx, window = measured_requests(sim)
    ttft, tpot, good, out_tokens, bad_ttft, bad_tpot = [], [], 0, 0, 0, 0
    for i in idx:
        t, e, n = log.ttft[i], log.e2e[i], log.out[i]
        if t < 0:
            continue
        tp = (e - t) / (n - 1) if n > 1 else 0.0
        ttft.append(t)
        tpot.append(tp)
        out_tokens += n
        bad_ttft += t > sla.ttft_s
        bad_tpot += tp > sla.tpot_s + 1e-12
        good += t <= sla.ttft_s and tp <= sla.tpot_s + 1e-12
    measured = len(idx)
    # the run ends with its last request or the link's last byte (deferred KV), not with
    # the last stale timer (a changed link or batch leaves its earlier timer to fire idle)
    duration = max(sim.last_end, sim.link.last_change, 1e-9)
    hw = sim.fleet.cost_per_hour({g.chip: sim.profile_price(g.chip) for g in sim.fleet.groups})
    wan_gb_h = sim.link.bytes_sent / 1e9 / duration * 3600
    cost = hw + wan_gb_h * sim.wan.price_per_gb
    goodput = good / window
    tokens_per_h = out_tokens / window * 3600
    util: dict[str, float] = {}
    for role, workers in sim.by_role.items():
        if workers:
            busy = sum(w.prefill_busy_s if w.decode is None else w.decode.occupancy_s
                       for w in workers)  # fmt: skip
            util[role.value] = busy / duration / len(workers)
    return SimResult(
        fleet=sim.fleet.label(), mode=sim.fleet.mode.value, chips=sim.fleet.chips(),
        requests=len(log.arrival), measured=measured, window_s=window, goodput_rps=goodput,
        attainment=good / measured if measured else 0.0,
        meets_sla=measured > 0 and good >= sla.attainment * measured,
        ttft_p50_s=_pct(ttft, 50), ttft_p90_s=_pct(ttft, 90),
        tpot_p50_s=_pct(tpot, 50), tpot_p90_s=_pct(tpot, 90),
        hardware_cost_per_hour=hw, wan_cost_per_hour=cost - hw, cost_per_hour=cost,
        bcr=goodput / cost if cost > 0 else 0.0,
        cost_per_mtok=cost / tokens_per_h * 1e6 if tokens_per_h > 0 else None,
        rld_token_share=sum(log.rld) / max(sum(log.out), 1),
        pipelines={p: c for p in PIPES if (c := sum(1 for x in log.pipe if PIPES[x] == p))},
        handoffs={h: c for h in HANDOFFS if (c := sum(1 for x in log.handoff if HANDOFFS[x] == h))},
        wan_utilisation=sim.link.utilisation(duration), wan_gb=sim.link.bytes_sent / 1e9,
        utilisation=util, fail_ttft=bad_ttft / max(measured, 1),
        fail_tpot=bad_tpot / max(measured, 1), rld_starved=sim.starved / max(len(log.arrival), 1),
        p_wait_p90_s=_pct([log.p_wait[i] for i in idx], 90),
        sim_wall_s=wall_s, sim_cpu_s=cpu_s, events=next(env._eid),  # simpy's event counter (private)
    )  # fmt: skip
