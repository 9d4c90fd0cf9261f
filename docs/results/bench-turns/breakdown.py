"""Where the time to the 32nd token goes, per mode and group of a `turns` run.

    .venv/bin/python docs/results/bench-turns/breakdown.py [RUN_DIR]  (default: this folder)

Reads RUN_DIR/requests.jsonl[.gz] (client times per content chunk, and for pdd's router the
`debug` view of each request: route, each RPC, each worker's first token). The 32nd token's
time is split into three parts that add up to it:

    ttft      the first token (P's, or colocated's prefill), from the client
    handoff   first token -> second token: pdd p_rld_md: UCX load + RLD's first step;
              p_md / pd_wan: MD's (D's) KV landing over the WAN + its extend step;
              colocated: one decode step
    steps     second -> 32nd token: 30 steps, switch stalls included

and, from the router's view: P's Generate (prefill as P runs it), RLD's tokens among the 32,
the median step of RLD and of MD (D), the largest gap after the second token. P50 over the
group's measured requests; ms.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from pdd.plan.validate import request_records

N = 32


def _p50(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _gen_ms(rec: dict, kv_stage: bool) -> float | None:
    for e in (rec.get("debug") or {}).get("timeline", []):
        if e["event"] == "generate" and bool(e.get("kv_stage")) == kv_stage:
            return e.get("duration_ms")
    return None


def _row(rec: dict) -> dict:
    t = [x * 1000 for x in rec["chunk_s"]]
    rld = min(rec["pdd"].get("rld_tokens", 0), N - 1)
    # token 1 is P's; then RLD's rld tokens; then MD's (D's); colocated: all its own
    rld_steps = [b - a for a, b in zip(t[1 : 1 + rld], t[2 : 1 + rld], strict=False)]
    md_steps = [b - a for a, b in zip(t[1 + rld : N - 1], t[2 + rld : N], strict=False)]
    return {
        "pipeline": rec["pdd"]["pipeline"], "ttft": t[0], "handoff": t[1] - t[0],
        "steps": t[N - 1] - t[1], "t32": t[N - 1], "rld_tokens": rld,
        "rld_step": _p50(rld_steps), "md_step": _p50(md_steps),
        "max_gap": max(b - a for a, b in zip(t[1 : N - 1], t[2:N], strict=False)),
        "p_generate": _gen_ms(rec, True), "md_cached": rec["pdd"].get("md_cached_tokens", 0),
    }  # fmt: skip


def main(run: Path) -> None:
    rows: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for rec in request_records(run):
        if rec["warmup"] or rec["error"] or len(rec["chunk_s"]) < N:
            continue
        rows[(rec["group"], rec["mode"])].append(_row(rec))
    cols = ["t32", "ttft", "handoff", "steps", "p_generate", "rld_tokens", "rld_step",
            "md_step", "max_gap", "md_cached"]  # fmt: skip
    print(f"{'group':10} {'mode':16} {'pipelines':22} " + " ".join(f"{c:>10}" for c in cols))
    for (group, mode), rs in sorted(rows.items(), key=lambda kv: (int(kv[0][0].split("-")[1]),
                                                                  kv[0][0], kv[0][1])):  # fmt: skip
        pipes = defaultdict(int)
        for r in rs:
            pipes[r["pipeline"]] += 1
        mix = ",".join(f"{p} {n}" for p, n in sorted(pipes.items()))
        cells = []
        for c in cols:
            v = _p50([r[c] for r in rs])
            cells.append(f"{'-' if v is None else f'{v:,.0f}':>10}")
        print(f"{group:10} {mode:16} {mix:22} " + " ".join(cells))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
