"""KV streamed while P prefills, against KV sent once P's token is out, on the lab, in one run.

    sudo .venv/bin/pdd serve --config configs/lab.yaml &
    sudo .venv/bin/pdd bench stream-kv --url http://10.77.0.6:8000/v1 --lab-prefix pdd \\
        --rates 100,50 --prompt-words 420,840 --rounds 5

For each WAN rate (``Lab.set_rate``, at most the rate the lab was built with), each round
sends, per cold prompt size (--prompt-words: ~3.6 tokens a word) and pipeline (p_md, p_rld_md),
one request with ``"pdd": {"stream_kv": true}`` and one with ``false`` (alternating which goes
first), each streaming tokens with ignore_eos: --tokens on p_md; on p_rld_md enough for RLD
to still be streaming when MD's KV lands (the prompt's KV at the link's rate, at
--rld-step-ms a token, plus --tokens), so the request switches to MD. Per request: TTFT (P's token), the
second token (p_md: MD's first; p_rld_md: RLD's first), MD's first token (p_rld_md: the
switch), the largest inter-token gap, and the record.

Issue 16's targets, per request: RLD's first token within P's prefill + 50 ms (TTFT stands
for P's prefill: it is P's token plus the router); MD's first token within max(prefill,
transfer) + 1 RTT + 100 ms (transfer: the bytes P queued for MD at the link's rate; MD's first
token also holds MD's extend step, so the bound is strict on MD's KV); p_md's largest gap cut
by at least P's prefill. Writes results.json and stream_kv.png under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pdd.bench.handoff_gap import stream_times
from pdd.bench.kv_wait import _pct
from pdd.bench.recompute import _cold
from pdd.config.lab import LabConfig
from pdd.lab import Lab

PIPELINES = ("p_md", "p_rld_md")
STREAMS = (True, False)


def measure(url: str, model: str, words: int, pipeline: str, stream: bool, tokens: int) -> dict:
    """One cold request; its times in ms since it was sent."""
    run = stream_times(url, model, _cold(words), tokens, "auto", pipeline=pipeline,
                       stream_kv=stream)  # fmt: skip
    rec = run["record"] or {}
    times = run.pop("times_ms")
    md_at = 1 + rec.get("rld_tokens", 0)  # P's token, RLD's, then MD's
    run |= {
        "pipeline_asked": pipeline, "stream_kv": stream, "words": words,
        "prompt_tokens": rec.get("prompt_tokens"),
        "md_first_ms": times[md_at] if md_at < len(times) else None,
    }  # fmt: skip
    return run


def _summary(runs: list[dict], rtt_ms: float) -> list[dict]:
    """Per (rate, words, pipeline, stream): P50 / P90 of each time, and the bounds met."""
    rows = []
    keys = sorted({(r["rate_mbit"], r["words"], r["pipeline_asked"], r["stream_kv"])
                   for r in runs}, key=lambda k: (-k[0], k[1], k[2], not k[3]))  # fmt: skip
    for rate, words, pipeline, stream in keys:
        group = [r for r in runs if (r["rate_mbit"], r["words"], r["pipeline_asked"],
                                     r["stream_kv"]) == (rate, words, pipeline, stream)]  # fmt: skip
        row = {"rate_mbit": rate, "words": words, "pipeline": pipeline, "stream_kv": stream,
               "n": len(group), "prompt_tokens": group[0]["prompt_tokens"]}  # fmt: skip
        for key in ("ttft_ms", "second_token_ms", "md_first_ms", "max_gap_ms"):
            values = [r[key] for r in group if r.get(key) is not None]
            if values:
                row[key] = {"p50": statistics.median(values), "p90": _pct(values, 0.9)}
        md_ok = [_md_bound(r, rate, rtt_ms) for r in group]
        row["md_first_within_bound"] = f"{sum(md_ok)}/{len(md_ok)}"
        if pipeline == "p_rld_md":
            rld_ok = [r["second_token_ms"] <= r["ttft_ms"] + 50 for r in group
                      if r["second_token_ms"] is not None]  # fmt: skip
            row["rld_first_within_prefill_50ms"] = f"{sum(rld_ok)}/{len(rld_ok)}"
        rows.append(row)
    return rows


def _md_bound(run: dict, rate_mbit: float, rtt_ms: float) -> bool:
    """MD's first token within max(P's prefill, the transfer) + 1 RTT + 100 ms."""
    if run["md_first_ms"] is None or run["ttft_ms"] is None:
        return False
    wire = (run["record"] or {}).get("wan_kv_bytes", 0)
    transfer_ms = wire * 8 / (rate_mbit * 1e6) * 1000
    return run["md_first_ms"] <= max(run["ttft_ms"], transfer_ms) + rtt_ms + 100


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="router base URL ending in /v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--lab-prefix", default="pdd")
    ap.add_argument("--rates", default="100,50", help="Mbit/s, in this order")
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="the lab's RTT (the bound's)")
    ap.add_argument("--prompt-words", default="420,840", help="cold prompt sizes, in words")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rld-step-ms", type=float, default=40.0)
    ap.add_argument("--kv-bytes-per-token", type=int, default=46_080, help="float32 SmolLM2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="results/stream_kv")
    args = ap.parse_args(argv)
    lab = Lab(LabConfig(prefix=args.lab_prefix))
    sizes = [int(w) for w in args.prompt_words.split(",")]
    runs = []
    for rate in (float(r) for r in args.rates.split(",")):
        lab.set_rate(rate)
        measure(args.url, args.model, sizes[0], "p_md", True, 4)  # P measures the new link
        time.sleep(2.5)  # the router's next Stats polls carry P's estimate
        for i in range(args.rounds):
            for words in sizes:
                for pipeline in PIPELINES:
                    tokens = args.tokens
                    if pipeline == "p_rld_md":  # RLD outlasts the transfer: MD takes over
                        kv_s = words * 3.6 * args.kv_bytes_per_token * 8 / (rate * 1e6)
                        tokens += int(kv_s * 1000 / args.rld_step_ms)
                    for stream in STREAMS if i % 2 == 0 else STREAMS[::-1]:
                        run = measure(args.url, args.model, words, pipeline, stream, tokens)
                        run |= {"rate_mbit": rate, "round": i}
                        runs.append(run)
                        brief = {k: run.get(k) for k in (
                            "rate_mbit", "words", "pipeline_asked", "stream_kv", "ttft_ms",
                            "second_token_ms", "md_first_ms", "max_gap_ms")}  # fmt: skip
                        print(json.dumps(brief), flush=True)
    summary = _summary(runs, args.rtt_ms)
    for row in summary:
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"args": vars(args), "summary": summary, "runs": runs}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    plot(runs, out / "stream_kv.png")
    return 0


def plot(runs: list[dict], path: Path) -> None:
    """MD's first token per request: streamed against sent after P's token, per rate, size
    and pipeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["rate_mbit"], r["words"], r["pipeline_asked"]) for r in runs},
                    key=lambda k: (-k[0], k[1], k[2]))  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(groups)), 4))
    for x, group in enumerate(groups):
        for dx, stream, color in ((-0.15, True, "tab:blue"), (0.15, False, "tab:orange")):
            ys = [r["md_first_ms"] / 1000 for r in runs
                  if (r["rate_mbit"], r["words"], r["pipeline_asked"]) == group
                  and r["stream_kv"] is stream and r["md_first_ms"] is not None]  # fmt: skip
            label = (
                ("streamed while P prefills" if stream else "sent after P's token")
                if x == 0
                else None
            )
            ax.scatter([x + dx] * len(ys), ys, color=color, alpha=0.6, s=24, label=label)
            if ys:
                ax.hlines(statistics.median(ys), x + dx - 0.1, x + dx + 0.1, color="k")
    prompt = {r["words"]: r["prompt_tokens"] for r in runs}
    ax.set_xticks(range(len(groups)),
                  [f"{g[0]:g} Mbit/s\n{prompt[g[1]]} tok\n{g[2]}" for g in groups], fontsize=8)  # fmt: skip
    ax.set_ylabel("MD's first token (s after the request)")
    ax.set_title("Cold prompts: KV streamed during P's prefill vs after it")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
