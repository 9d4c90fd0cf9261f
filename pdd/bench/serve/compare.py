"""The headline comparison: the candidate mode (pdd) against the baseline (pd_wan), same run.

Pure: reads two ``Summary``s of one workload and the configured targets, returns checks::

    P90 / P99 TTFT reduction   1 - candidate / baseline           >= target
    WAN bytes factor           baseline / candidate               >= target
                               (metered link bytes when both modes ran on a metered lab,
                                else the KV bytes P queued for the decoder)
    SLA goodput gain           candidate / baseline - 1           >= target
    RLD share of output tokens candidate's                        <  target
    failed requests            every mode, every workload, warm-up included == 0
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdd.bench.serve.config import CompareConfig
from pdd.bench.serve.metrics import Summary
from pdd.bench.serve.results import ModeResult


@dataclass(frozen=True, slots=True)
class Check:
    metric: str
    baseline: float | None
    candidate: float | None
    value: float | None  # the derived figure the target is about
    target: str
    met: bool | None  # None: not measurable in this run


def _reduction(base: float | None, cand: float | None) -> float | None:
    return None if not base or cand is None else 1 - cand / base


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def _wan(base: Summary, cand: Summary) -> tuple[str, float | None, float | None]:
    if base.link_bytes_total is not None and cand.link_bytes_total is not None:
        return "WAN bytes (link, metered)", base.link_bytes_total, cand.link_bytes_total
    return "WAN KV bytes (queued for MD)", base.wan_bytes_total, cand.wan_bytes_total


def checks(base: Summary, cand: Summary, cfg: CompareConfig) -> list[Check]:
    p90 = _reduction(base.ttft_p90_s, cand.ttft_p90_s)
    p99 = _reduction(base.ttft_p99_s, cand.ttft_p99_s)
    wan_name, wan_b, wan_c = _wan(base, cand)
    factor = None if not wan_c or wan_b is None else wan_b / wan_c
    gain = None if not base.goodput_rps else cand.goodput_rps / base.goodput_rps - 1
    share = cand.rld_token_share
    return [
        Check("P90 TTFT reduction", base.ttft_p90_s, cand.ttft_p90_s, p90,
              f">= {cfg.ttft_p90_reduction:.0%}", _at_least(p90, cfg.ttft_p90_reduction)),
        Check("P99 TTFT reduction", base.ttft_p99_s, cand.ttft_p99_s, p99,
              f">= {cfg.ttft_p99_reduction:.0%}", _at_least(p99, cfg.ttft_p99_reduction)),
        Check(wan_name + " factor", wan_b, wan_c, factor, f">= {cfg.wan_bytes_factor:g}x",
              _at_least(factor, cfg.wan_bytes_factor)),
        Check("SLA goodput gain", base.goodput_rps, cand.goodput_rps, gain,
              f">= +{cfg.goodput_gain:.0%}", _at_least(gain, cfg.goodput_gain)),
        Check("RLD share of output tokens", base.rld_token_share, share, share,
              f"< {cfg.rld_share_max:.0%}", None if share is None else share < cfg.rld_share_max),
    ]  # fmt: skip


def compare(modes: list[ModeResult], cfg: CompareConfig) -> dict[str, Any] | None:
    """The comparison as JSON, or None when either mode did not run the workload."""
    by_name = {m.name: m for m in modes}
    base, cand = by_name.get(cfg.baseline), by_name.get(cfg.candidate)
    if base is None or cand is None:
        return None
    wb, wc = base.workloads.get(cfg.workload), cand.workloads.get(cfg.workload)
    if wb is None or wc is None:
        return None
    rows = checks(wb.summary, wc.summary, cfg)
    errors = {m.name: m.errors() + (1 if m.error else 0) for m in modes}
    rows.append(
        Check("failed requests (all modes)", errors.get(cfg.baseline), errors.get(cfg.candidate),
              sum(errors.values()), "== 0", sum(errors.values()) == 0)
    )  # fmt: skip
    return {
        "baseline": cfg.baseline,
        "candidate": cfg.candidate,
        "workload": cfg.workload,
        "errors_by_mode": errors,
        "checks": [asdict(c) for c in rows],
    }


def _cell(metric: str, v: float | None) -> str:
    """A baseline / candidate measurement in the metric's unit."""
    if v is None:
        return "-"
    if "TTFT" in metric:
        return f"{v * 1000:.0f} ms"
    if "bytes" in metric:
        return f"{v / 1e6:.1f} MB"
    if "goodput" in metric:
        return f"{v:.3g} req/s"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _figure(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    if "factor" in metric:
        return f"{v:.2f}x"
    return f"{v:.1%}" if isinstance(v, float) else str(v)


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"## {result['candidate']} vs {result['baseline']} (`{result['workload']}`)",
        "",
        "| check | baseline | candidate | figure | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["checks"]:
        m = c["metric"]
        met = {True: "yes", False: "**no**", None: "-"}[c["met"]]
        lines.append(
            f"| {m} | {_cell(m, c['baseline'])} | {_cell(m, c['candidate'])} "
            f"| {_figure(m, c['value'])} | {c['target']} | {met} |"
        )
    return [*lines, ""]
