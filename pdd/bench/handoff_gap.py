"""Inter-token gaps around the RLD -> MD handoff, One-Shot against Catch-Up, in one run.

    .venv/bin/pdd bench handoff-gap --url http://10.77.0.6:8000/v1 [--tokens 160]

Run it against a PDD system whose WAN is slow enough that RLD decodes for a while before MD's
KV lands (`pdd serve --config configs/lab.yaml`). Each request uses a cold prompt (unique
words) so the whole prompt's KV crosses the WAN, forces `p_rld_md` with one handoff mode, and
streams `--tokens` tokens with ignore_eos. Reports per mode: the gap at the switch (between
RLD's last token and MD's first), the largest gap anywhere after the first token, the median
gap, and the record. Writes results/handoff_gap/results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx


def stream_times(url: str, model: str, prompt: str, tokens: int, handoff: str,
                 pipeline: str = "p_rld_md", kv_wait: str | None = None,
                 one_off: bool = False, stream_kv: bool | None = None) -> dict:  # fmt: skip
    """One streamed greedy request (ignore_eos): when each text chunk came, the record, and
    the gaps (the switch: RLD's last token to MD's first)."""
    pdd: dict[str, object] = {"pipeline": pipeline, "handoff": handoff}
    if kv_wait is not None:
        pdd["kv_wait"] = kv_wait
    if one_off:
        pdd["one_off"] = True
    if stream_kv is not None:
        pdd["stream_kv"] = stream_kv
    body = {
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "pdd": pdd,
    }  # fmt: skip
    times, record, t0 = [], None, time.perf_counter()
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices") or []):
                times.append(time.perf_counter() - t0)
            record = chunk.get("pdd") or record
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    switch = 1 + (record or {}).get("rld_tokens", 0)  # P's token, then RLD's, then MD's
    return {
        "handoff": handoff,
        "record": record,
        "ttft_ms": times[0] * 1000 if times else None,
        "second_token_ms": times[1] * 1000 if len(times) > 1 else None,
        "text_chunks": len(times),
        "times_ms": [t * 1000 for t in times],
        "switch_gap_ms": gaps[switch - 1] * 1000 if 0 < switch <= len(gaps) else None,
        "max_gap_ms": max(gaps) * 1000 if gaps else None,
        "median_gap_ms": statistics.median(gaps) * 1000 if gaps else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="router base URL ending in /v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--prompt-words", type=int, default=250, help="~9 tokens per word (fresh tags)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--handoffs", default="one_shot,catch_up", help="handoff modes, in order")
    ap.add_argument("--out", default="results/handoff_gap")
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.repeats):
        for handoff in args.handoffs.split(","):
            tag = uuid.uuid4().hex[:6]
            prompt = " ".join(f"{tag}{j}" for j in range(args.prompt_words))
            runs.append(stream_times(args.url, args.model, prompt, args.tokens, handoff))
            rec = runs[-1]["record"] or {}
            brief = {k: v for k, v in runs[-1].items() if k not in ("record", "times_ms")}
            brief |= {k: rec.get(k) for k in ("handoff", "rld_tokens", "handoff_rounds")}
            print(json.dumps(brief), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
