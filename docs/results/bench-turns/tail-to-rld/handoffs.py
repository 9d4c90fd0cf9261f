"""Per cold p_rld_md request of a turns run: ms from P's token to RLD's first token (the
handoff), and from RLD's Generate to its first token, read off the router's timelines.

    python docs/results/bench-turns/tail-to-rld/handoffs.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from pdd.plan.validate import request_records


def handoffs(run: Path) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {}
    for r in request_records(run):
        debug = r.get("debug")
        if not debug or not str(r.get("group", "")).startswith("cold"):
            continue
        first = {e["worker"]: e["t_ms"] for e in debug["timeline"] if e["event"] == "first_token"}
        called = {e["worker"]: e["t_ms"] for e in debug["timeline"] if e["event"] == "generate"}
        if "rld" in first and "p" in first:
            row = (round(first["rld"] - first["p"]), round(first["rld"] - called["rld"]))
            out.setdefault(r["group"], []).append(row)
    return dict(sorted(out.items()))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(arg)
        for group, rows in handoffs(Path(arg)).items():
            print(f"  {group:10} " + "  ".join(f"{h:>5} ({g})" for h, g in rows))
