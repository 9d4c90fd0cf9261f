"""BCR against prefix hit rate (PDD's "bathtub"): for each hit rate, the plan's search again.

For every candidate (mode and chip per role) and every hit rate, the synthetic agentic
workload is regenerated at that hit rate (everything else equal) and the fleet search is run:
the curve is the best BCR a fleet sized for that hit rate reaches, which is how the PDD report
reads it (an operator sizes for the traffic he has). Points where no fleet meets the SLA are
null, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdd.plan.search import Searcher
from pdd.plan.workload import AgenticWorkload, agentic
from pdd.protocol import Role, RouterMode


def sweep(searcher: Searcher, base: AgenticWorkload, hits: list[float],
          cands: list[tuple[RouterMode, dict[Role, str]]]) -> list[dict[str, Any]]:  # fmt: skip
    points = []
    for h in hits:
        searcher.workload = agentic(base.model_copy(update={"hit_rate": h, "turns": 0}))
        for mode, chips in cands:
            res = searcher.search(mode, chips)
            b = res.best
            points.append({
                "hit_rate": h, "candidate": res.label, "fleet": b.fleet if b else None,
                "bcr": b.bcr if b else None, "cost_per_hour": b.cost_per_hour if b else None,
                "goodput_rps": b.goodput_rps if b else None,
                "rld_token_share": b.rld_token_share if b else None,
                "wan_utilisation": b.wan_utilisation if b else None,
                "infeasible": res.infeasible, "simulations": len(res.tried),
            })  # fmt: skip
    return points


def write(out_dir: Path, points: list[dict[str, Any]], inputs: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "bathtub.json"
    js.write_text(json.dumps({"inputs": inputs, "points": points}, indent=2) + "\n")
    lines = ["| hit rate | candidate | fleet | cost/h | BCR | RLD share | WAN util |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for p in points:
        if p["bcr"] is None:
            lines.append(
                f"| {p['hit_rate']:.2f} | {p['candidate']} | none: {p['infeasible']} | | | | |"
            )
        else:
            lines.append(f"| {p['hit_rate']:.2f} | {p['candidate']} | {p['fleet']} | "
                         f"{p['cost_per_hour']:.3g} | {p['bcr']:.4g} | "
                         f"{p['rld_token_share']:.1%} | {p['wan_utilisation']:.0%} |")  # fmt: skip
    md = out_dir / "bathtub.md"
    md.write_text("\n".join(lines) + "\n")
    out = [js, md]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return out
    fig, ax = plt.subplots(figsize=(7, 4))
    for cand in dict.fromkeys(p["candidate"] for p in points):
        xs = [(p["hit_rate"], p["bcr"]) for p in points if p["candidate"] == cand and p["bcr"]]
        ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", label=cand)
    ax.set_xlabel("prefix hit rate")
    ax.set_ylabel("BCR (goodput req/s per cost/h)")
    ax.set_title("BCR against prefix hit rate (each point: the fleet sized for it)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = out_dir / "bathtub.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [*out, png]
