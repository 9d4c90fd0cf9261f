"""The plan's outputs: a markdown table, JSON, and a PNG (matplotlib, if installed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pdd.plan.search import SearchResult


def _n(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


HEADER = ("| mode | chips per role | instances | chips | cost/h | goodput req/s | BCR | "
          "cost / M tok | RLD token share | WAN util | TTFT P50 / P90 s | TPOT P50 ms | "
          "SLA met |")  # fmt: skip


def table(results: list[SearchResult]) -> str:
    lines = [HEADER, "|" + " --- |" * (HEADER.count("|") - 1)]
    for r in results:
        chips = " ".join(f"{k.value}={v}" for k, v in r.chips.items())
        b = r.best
        if b is None:
            lines.append(f"| {r.mode.value} | {chips} | no fleet meets the SLA: {r.infeasible} "
                         "| | | | | | | | | | |")  # fmt: skip
            continue
        chip_mix = " + ".join(f"{n} {c}" for c, n in sorted(b.chips.items()))
        lines.append(
            f"| {r.mode.value} | {chips} | {b.fleet} | {chip_mix} | {_n(b.cost_per_hour)} | "
            f"{_n(b.goodput_rps)} | {_n(b.bcr)} | {_n(b.cost_per_mtok)} | "
            f"{b.rld_token_share:.1%} | {b.wan_utilisation:.0%} | "
            f"{_n(b.ttft_p50_s)} / {_n(b.ttft_p90_s)} | {_n(b.tpot_p50_s * 1000)} | "
            f"{b.attainment:.0%} |"
        )
    return "\n".join(lines)


def best_overall(results: list[SearchResult]) -> SearchResult | None:
    met = [r for r in results if r.best is not None]
    return max(met, key=lambda r: r.best.bcr) if met else None  # type: ignore[union-attr]


def to_json(results: list[SearchResult], inputs: dict[str, Any]) -> dict[str, Any]:
    best = best_overall(results)
    return {
        "inputs": inputs,
        "best": None if best is None else {"label": best.label, **best.best.to_dict()},  # type: ignore[union-attr]
        "candidates": [
            {
                "mode": r.mode.value,
                "chips": {k.value: v for k, v in r.chips.items()},
                "infeasible": r.infeasible,
                "best": None if r.best is None else r.best.to_dict(),
                "simulations": len(r.tried),
            }
            for r in results
        ],
    }


def write(out_dir: Path, results: list[SearchResult], inputs: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "plan.json", out_dir / "plan.md"]
    paths[0].write_text(json.dumps(to_json(results, inputs), indent=2, default=str) + "\n")
    paths[1].write_text(table(results) + "\n")
    png = plot(out_dir / "plan.png", results)
    return paths + ([png] if png else [])


def plot(path: Path, results: list[SearchResult]) -> Path | None:
    """BCR and cost per candidate; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    met = [r for r in results if r.best is not None]
    if not met:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r.label for r in met]
    ax1.barh(labels, [r.best.bcr for r in met])  # type: ignore[union-attr]
    ax1.set_xlabel("BCR (SLA goodput req/s per cost/h)")
    ax2.barh(labels, [r.best.cost_per_hour for r in met])  # type: ignore[union-attr]
    ax2.set_xlabel("cost per hour")
    ax2.set_yticks([])
    fig.suptitle("pdd plan: the cheapest fleet meeting the SLA, per mode and chip mix")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
