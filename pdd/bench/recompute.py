"""Recompute or wait on the lab: when MD's first token of a cold p_md prompt comes, as the
WAN link changes under a running fleet (router.pdd.md_recompute as it comes: the prompt is
over md_recompute_max_tokens, so MD computes it on p_md only where its KV would take longer
than ttft_budget_s).

    sudo .venv/bin/pdd serve --config configs/lab.yaml --set lab.rate_mbit=1000 &
    sudo .venv/bin/pdd bench recompute --url http://10.77.0.6:8000/v1 --lab-prefix pdd \\
        --rates 1000,100,10

For each rate (each at most the rate the lab was built with; set with ``Lab.set_rate``): one
cold p_rld_md request of --probe-tokens lets P measure the link (one-off: its WAN transfer is
cut when RLD ends), then --repeats cold prompts of --prompt-words words (~3.6 tokens a word) forced
p_md stream --tokens tokens each. Per request: TTFT (P's prefill), MD's first token (the second
token), whether MD computed the prompt, the WAN KV bytes and the route's figures. The bound
issue 16 sets, at the slow rate: MD's first token within a colocated prefill of the prompt +
1 RTT + 300 ms; P's TTFT stands for that prefill here (the same engine and core, plus the
router; P also stages its KV, so it is, if anything, a little longer). Writes
results/recompute/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

import httpx

from pdd.bench.handoff_gap import stream_times
from pdd.config.lab import LabConfig
from pdd.lab import Lab


def _p_bandwidth(url: str) -> float:
    rows = httpx.get(url.removesuffix("/v1") + "/debug/workers", timeout=10).json()["workers"]
    return next(w["wan"]["bandwidth_bps"] for w in rows if w["role"] == "prefill")


def _cold(words: int) -> str:
    """A prompt no cache holds: a fresh tag first changes the hash of every block after it."""
    return f"Request {uuid.uuid4().hex[:8]}: " + " ".join(f"w{j}" for j in range(words))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="router base URL ending in /v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--lab-prefix", default="pdd")
    ap.add_argument("--rates", default="1000,10", help="Mbit/s, in this order")
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="the lab's RTT (the bound's)")
    ap.add_argument("--prompt-words", type=int, default=420)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--probe-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/recompute")
    args = ap.parse_args(argv)
    lab = Lab(LabConfig(prefix=args.lab_prefix))
    runs = []
    for rate in (float(r) for r in args.rates.split(",")):
        lab.set_rate(rate)
        # P measures the link on a cold p_rld_md request (one-off: cut when RLD ends)
        stream_times(args.url, args.model, _cold(args.prompt_words), args.probe_tokens, "auto",
                     one_off=True)  # fmt: skip
        time.sleep(2.5)  # the router's next Stats polls carry P's estimate
        bandwidth = _p_bandwidth(args.url)
        for _ in range(args.repeats):
            run = stream_times(args.url, args.model, _cold(args.prompt_words), args.tokens,
                               "auto", pipeline="p_md")  # fmt: skip
            rec = run["record"] or {}
            run |= {"rate_mbit": rate, "p_bandwidth_bps": bandwidth}
            if run["second_token_ms"] is not None and run["ttft_ms"] is not None:
                bound = run["ttft_ms"] + args.rtt_ms + 300
                run["md_first_within_bound"] = run["second_token_ms"] <= bound
            runs.append(run)
            brief = {k: run.get(k) for k in ("rate_mbit", "ttft_ms", "second_token_ms",
                                             "md_first_within_bound", "max_gap_ms")}  # fmt: skip
            brief |= {k: rec.get(k) for k in ("md_computed", "wan_kv_bytes", "prompt_tokens")}
            print(json.dumps(brief), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    plot(runs, out / "md_first_token.png")
    return 0


def plot(runs: list[dict], path: Path) -> None:
    """MD's first token after P's, per request and link rate: computed by MD or waited for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    rates = sorted({r["rate_mbit"] for r in runs}, reverse=True)
    for computed, mark, label in ((False, "o", "waited for the KV"), (True, "^", "MD computed")):
        pts = [(rates.index(r["rate_mbit"]), (r["second_token_ms"] - r["ttft_ms"]) / 1000)
               for r in runs if bool((r["record"] or {}).get("md_computed")) is computed]  # fmt: skip
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=mark, label=label, s=40)
    ax.set_xticks(range(len(rates)), [f"{r:g} Mbit/s" for r in rates])
    ax.set_yscale("log")
    ax.set_ylabel("MD's first token after P's (s)")
    ax.set_title("Cold p_md prompt: recompute or wait")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
