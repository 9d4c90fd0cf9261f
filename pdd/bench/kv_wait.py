"""p_md on the lab: MD's first token when its Generate waits on MD for the KV (the default,
``kv_wait: in_generate``) against the older flow (``await_first``: AwaitKv answers, then the
Generate is sent), the two interleaved in one run.

    sudo .venv/bin/pdd serve --config configs/lab.yaml --set lab.delay_ms=25 &
    sudo .venv/bin/pdd bench kv-wait --url http://10.77.0.6:8000/v1 --rounds 10

A conversation's prefix (--prefix-words words, ~3.6 tokens a word) is put in MD's DRC by one
p_md request; then each round sends, in alternating order, one warm p_md request per flow:
the prefix plus a fresh tail of --tail-words words, so only the tail's blocks cross the WAN
(the agentic case: most of the prompt is on MD). Per request: TTFT (P's token) and MD's first
token after it (the second token, MD's Generate extending its prompt). Reports per flow the
P50 / P90 of that gap, and the difference and ratio of the medians. The difference is one
WAN round trip by construction; the run measures what it is worth at the lab's RTT. Writes
results/kv_wait/results.json and md_first_token.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid
from pathlib import Path

import httpx

from pdd.bench.handoff_gap import stream_times

FLOWS = ("in_generate", "await_first")


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{j}" for j in range(n))


def _lab_rtt_ms(url: str) -> float | None:
    rows = httpx.get(url.removesuffix("/v1") + "/debug/workers", timeout=10).json()["workers"]
    rtts = [w["wan"]["rtt_s"] for w in rows if w.get("wan") and w["wan"].get("rtt_s")]
    return 1000 * rtts[0] if rtts else None


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="router base URL ending in /v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--tail-words", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--out", default="results/kv_wait")
    args = ap.parse_args(argv)
    prefix = f"Conversation {uuid.uuid4().hex[:8]}: " + _words("w", args.prefix_words)
    stream_times(args.url, args.model, prefix, 4, "auto", pipeline="p_md")  # MD learns it
    runs = []
    for i in range(args.rounds):
        order = FLOWS if i % 2 == 0 else FLOWS[::-1]
        for flow in order:
            prompt = f"{prefix} turn{i}{flow[0]} " + _words(f"t{i}{flow[0]}", args.tail_words)
            run = stream_times(args.url, args.model, prompt, args.tokens, "auto",
                               pipeline="p_md", kv_wait=flow)  # fmt: skip
            rec = run["record"] or {}
            run |= {"flow": flow, "round": i}
            if run["second_token_ms"] is not None and run["ttft_ms"] is not None:
                run["md_after_p_ms"] = run["second_token_ms"] - run["ttft_ms"]
            runs.append(run)
            brief = {k: run.get(k) for k in ("flow", "ttft_ms", "md_after_p_ms")}
            brief |= {k: rec.get(k) for k in ("pipeline", "md_cached_tokens", "wan_kv_bytes")}
            print(json.dumps(brief), flush=True)
    summary = {"lab_rtt_ms": _lab_rtt_ms(args.url)}
    for flow in FLOWS:
        gaps = [r["md_after_p_ms"] for r in runs if r["flow"] == flow and "md_after_p_ms" in r]
        if gaps:
            summary[flow] = {"n": len(gaps), "p50_ms": statistics.median(gaps),
                             "p90_ms": _pct(gaps, 0.9)}  # fmt: skip
    if all(f in summary for f in FLOWS):
        new, old = summary["in_generate"]["p50_ms"], summary["await_first"]["p50_ms"]
        summary["p50_saved_ms"] = old - new
        summary["p50_ratio"] = new / old if old else None
    print(json.dumps(summary), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"args": vars(args), "summary": summary, "runs": runs}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    plot(runs, out / "md_first_token.png")
    return 0


def plot(runs: list[dict], path: Path) -> None:
    """MD's first token after P's, per warm p_md request, one column per flow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for x, flow in enumerate(FLOWS):
        ys = [r["md_after_p_ms"] for r in runs if r["flow"] == flow and "md_after_p_ms" in r]
        ax.scatter([x] * len(ys), ys, alpha=0.6, s=30)
        if ys:
            ax.hlines(statistics.median(ys), x - 0.25, x + 0.25, color="k")
    ax.set_xticks(range(len(FLOWS)), ["Generate waits on MD", "AwaitKv, then Generate"])
    ax.set_xlim(-0.6, len(FLOWS) - 0.4)
    ax.set_ylabel("MD's first token after P's (ms)")
    ax.set_title("Warm p_md request (the tail crosses)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
