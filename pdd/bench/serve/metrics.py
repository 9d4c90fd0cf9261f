"""Benchmark math: percentiles, TPOT, SLA goodput, hardware cost, BCR, per-phase summaries.

Pure functions over ``RequestRecord``s; no I/O. Definitions (DESIGN.md, PDD-FACTS.md):

- TTFT: client send -> first content chunk. E2E: send -> end of the stream.
- TPOT = (E2E - TTFT) / (output tokens - 1); undefined for one-token answers.
- ITL: gaps between content chunks; the largest stall is the largest gap.
- T32: send -> the 32nd content chunk (the 32nd token where the server streams one token per
  chunk, as vLLM and pdd do), over requests that streamed that many: the whole stream's start,
  not only its first token.
- SLA goodput = requests meeting TTFT <= sla.ttft_s and TPOT <= sla.tpot_s, per second of the
  phase's wall time (an undefined TPOT meets the TPOT limit).
- BCR = SLA goodput / hardware cost per hour (sum over worker kinds of count * price).
- Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdd.bench.serve.client import RequestRecord
from pdd.bench.serve.config import SlaConfig
from pdd.errors import ConfigError

MAX_ERRORS_SHOWN = 5


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def tpot(ttft_s: float, e2e_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first; None when there is no second token."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def record_tpot(rec: RequestRecord) -> float | None:
    if not rec.ok or rec.ttft_s is None or rec.e2e_s is None:
        return None
    return tpot(rec.ttft_s, rec.e2e_s, rec.output_tokens)


def gaps(times: Sequence[float]) -> list[float]:
    """Inter-chunk gaps of one stream (arrival times in order)."""
    return [b - a for a, b in zip(times, times[1:], strict=False)]


NTH_TOKEN = 32


def time_to_nth(rec: RequestRecord, n: int = NTH_TOKEN) -> float | None:
    """Send -> the ``n``-th content chunk; None when the stream had fewer."""
    return rec.chunk_s[n - 1] if rec.ok and len(rec.chunk_s) >= n else None


def meets_sla(rec: RequestRecord, sla: SlaConfig) -> bool:
    if not rec.ok or rec.ttft_s is None or rec.ttft_s > sla.ttft_s:
        return False
    t = record_tpot(rec)
    return t is None or t <= sla.tpot_s


def goodput(records: Iterable[RequestRecord], sla: SlaConfig, wall_s: float) -> float:
    """Requests per second that met the SLA."""
    if wall_s <= 0:
        return 0.0
    return sum(meets_sla(r, sla) for r in records) / wall_s


def cost_per_hour(workers: dict[str, int], prices: dict[str, float]) -> float:
    """Hardware cost of a mode; raises ConfigError for a kind without a price."""
    missing = sorted(k for k in workers if k not in prices)
    if missing:
        raise ConfigError(f"no cost.per_hour for worker kind(s) {missing} (have {sorted(prices)})")
    return sum(n * prices[k] for k, n in workers.items())


def bcr(goodput_rps: float, cost: float) -> float | None:
    """Benefit-cost ratio: SLA goodput (req/s) per unit of hardware cost per hour."""
    return goodput_rps / cost if cost > 0 else None


@dataclass
class Summary:
    """Measured requests of one phase (or several phases added up)."""

    requests: int = 0
    ok: int = 0
    errors: int = 0
    not_sent: int = 0
    wall_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p90_s: float | None = None
    tpot_p99_s: float | None = None
    t32_p50_s: float | None = None  # send -> 32nd token (time_to_nth)
    t32_p90_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    max_stall_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p90_s: float | None = None
    e2e_p99_s: float | None = None
    output_tokens: int = 0
    output_tok_s: float = 0.0
    sla_ok: int = 0
    sla_attainment: float | None = None
    goodput_rps: float = 0.0
    wan_bytes_total: int = 0
    wan_bytes_per_request: float | None = None
    link_bytes_total: int | None = None  # metered on the lab's WAN (every byte, both ways)
    link_bytes_per_request: float | None = None
    target_hit_mean: float | None = None
    prefix_hit_rate: float | None = None
    drc_hit_rate: float | None = None
    rld_token_share: float | None = None
    pipelines: dict[str, int] = field(default_factory=dict)
    handoffs: dict[str, int] = field(default_factory=dict)
    handoff_rounds_mean: float | None = None
    cost_per_hour: float = 0.0
    bcr: float | None = None
    first_errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(
    records: Sequence[RequestRecord],
    wall_s: float,
    sla: SlaConfig,
    cost: float,
    not_sent: int = 0,
    link_bytes: int | None = None,
) -> Summary:
    """Summary of measured ``records`` over ``wall_s`` seconds (warm-up records are ignored)."""
    recs = [r for r in records if not r.warmup]
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpots = [t for t in (record_tpot(r) for r in ok) if t is not None]
    itl = [g for r in ok for g in gaps(r.chunk_s)]
    t32 = [t for t in map(time_to_nth, ok) if t is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    targets = [r.target_hit for r in ok if r.target_hit is not None]
    sla_ok = sum(meets_sla(r, sla) for r in recs)
    good = sla_ok / wall_s if wall_s > 0 else 0.0
    wan = sum(r.pdd.wan_kv_bytes for r in ok)
    rounds = [r.pdd.handoff_rounds for r in ok if r.pdd.handoff not in ("none", "")]
    return Summary(
        requests=len(recs),
        ok=len(ok),
        errors=len(recs) - len(ok),
        not_sent=not_sent,
        wall_s=wall_s,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpots, 50),
        tpot_p90_s=percentile(tpots, 90),
        tpot_p99_s=percentile(tpots, 99),
        t32_p50_s=percentile(t32, 50),
        t32_p90_s=percentile(t32, 90),
        itl_p50_s=percentile(itl, 50),
        itl_p99_s=percentile(itl, 99),
        max_stall_s=max(itl) if itl else None,
        e2e_p50_s=percentile(e2e, 50),
        e2e_p90_s=percentile(e2e, 90),
        e2e_p99_s=percentile(e2e, 99),
        output_tokens=out_tokens,
        output_tok_s=out_tokens / wall_s if wall_s > 0 else 0.0,
        sla_ok=sla_ok,
        sla_attainment=_ratio(sla_ok, len(recs)),
        goodput_rps=good,
        wan_bytes_total=wan,
        wan_bytes_per_request=_ratio(wan, len(ok)),
        link_bytes_total=link_bytes,
        link_bytes_per_request=None if link_bytes is None else _ratio(link_bytes, len(recs)),
        target_hit_mean=sum(targets) / len(targets) if targets else None,
        prefix_hit_rate=_ratio(sum(r.cached_tokens for r in ok), prompt_tokens),
        drc_hit_rate=_ratio(sum(r.pdd.md_cached_tokens for r in ok), prompt_tokens),
        rld_token_share=_ratio(sum(r.pdd.rld_tokens for r in ok), out_tokens),
        pipelines=dict(sorted(Counter(r.pdd.pipeline for r in ok).items())),
        handoffs=dict(sorted(Counter(r.pdd.handoff for r in ok).items())),
        handoff_rounds_mean=sum(rounds) / len(rounds) if rounds else None,
        cost_per_hour=cost,
        bcr=bcr(good, cost),
        first_errors=[r.error for r in recs if r.error][:MAX_ERRORS_SHOWN],
    )
