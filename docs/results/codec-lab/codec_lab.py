"""Per-codec table of the WAN codec run on the lab (configs/bench/codec.yaml, issue 17).

    python docs/results/codec-lab/codec_lab.py RESULTS_FOLDER   # writes codec_lab.json there

From the run's results.json (the lab's metered link bytes per workload) and requests.jsonl
(one line per request, warm-ups included), per mode (= P's transfer.wan_codec), measured
requests only:

    link MB / cold req    bytes that crossed the lab's WAN during the cold sweep (hit 0.0,
                          ~1,536-token prompts), per request (both directions, headers and
                          acks included)
    raw MB / cold req     P's KV for those requests before the codec (wan_kv_raw_bytes)
    MD first token        p_md requests: seconds from send to the client's arrival of MD's
                          first token (content chunk 1: chunk 0 is P's token)
    switch                p_rld_md requests handed off to MD: seconds from send to MD's first
                          token (content chunk 1 + rld_tokens)
    cold switch           the same for the cold requests, where a request RLD finished (no
                          switch: the KV came too late) counts as switching after its end
                          (censored: the median is then a lower bound, marked >=); and the
                          first cold request alone (the link idle when it arrived)
    agentic TTFT P50/P90  the agentic workload (results.json)

Ratios are against mode `none` of the same run.
"""

import json
import statistics
import sys
from pathlib import Path


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def md_first_token_s(r: dict) -> float | None:
    """Send -> MD's first token, from the client's chunk arrivals (one chunk per token)."""
    pdd, chunks = r["pdd"], r["chunk_s"]
    if pdd["pipeline"] == "p_md":
        i = 1
    elif pdd["pipeline"] == "p_rld_md" and pdd["handoff"] in ("one_shot", "catch_up"):
        i = 1 + pdd["rld_tokens"]
    else:
        return None
    return chunks[i] if i < len(chunks) else None


def switch_or_end(r: dict) -> float:
    """MD's first token, else the request's end (it never switched: a lower bound)."""
    t = md_first_token_s(r)
    return r["e2e_s"] if t is None else t


def table(folder: Path) -> dict:
    results = json.loads((folder / "results.json").read_text())
    rows: dict[str, dict] = {}
    with (folder / "requests.jsonl").open() as f:
        reqs = [r for r in map(json.loads, f) if not r["warmup"] and r["error"] is None]
    for mode, m in results["modes"].items():
        cold = [r for r in reqs if r["mode"] == mode and r["workload"] == "sweep"]
        every = [r for r in reqs if r["mode"] == mode]
        sweep, agentic = (m["workloads"][w]["summary"] for w in ("sweep", "agentic"))
        by = {p: [t for r in every if r["pdd"]["pipeline"] == p
                  if (t := md_first_token_s(r)) is not None] for p in ("p_md", "p_rld_md")}  # fmt: skip
        rows[mode] = {
            "cold_requests": len(cold),
            "cold_link_MB_per_request": sweep["link_bytes_per_request"] / 1e6,
            "cold_raw_MB_per_request": statistics.mean(r["pdd"]["wan_kv_raw_bytes"] for r in cold)
            / 1e6
            if cold
            else None,
            "cold_wire_MB_per_request": statistics.mean(r["pdd"]["wan_kv_bytes"] for r in cold)
            / 1e6
            if cold
            else None,
            "cold_pipelines": {
                p: sum(r["pdd"]["pipeline"] == p for r in cold) for p in ("p_md", "p_rld_md")
            },  # fmt: skip
            "md_first_token_p_md_s_median": median(by["p_md"]),
            "md_first_token_p_md_n": len(by["p_md"]),
            "switch_p_rld_md_s_median": median(by["p_rld_md"]),
            "switch_p_rld_md_n": len(by["p_rld_md"]),
            "cold_switch_s_median": median([switch_or_end(r) for r in cold]),
            "cold_never_switched": sum(md_first_token_s(r) is None for r in cold),
            "first_cold_switch_s": switch_or_end(min(cold, key=lambda r: r["index"]))
            if cold
            else None,
            "agentic_ttft_p50_s": agentic["ttft_p50_s"],
            "agentic_ttft_p90_s": agentic["ttft_p90_s"],
            "agentic_link_MB": agentic["link_bytes_total"] / 1e6,
        }
    base = rows.get("none")
    for row in rows.values():
        keys = ("cold_link_MB_per_request", "cold_switch_s_median", "first_cold_switch_s",
                "agentic_ttft_p50_s")  # fmt: skip
        for key in keys:
            if base and base[key] and row[key] is not None:
                row[key.replace("_median", "") + "_vs_none"] = row[key] / base[key]
    return rows


def markdown(rows: dict) -> str:
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    out = ["| codec | link MB / cold req (x none) | KV on the wire MB (raw) | MD 1st token p_md, "
           "median (n) | switch p_rld_md, median (n) | cold switch, median (x none) | first cold "
           "switch (x none) | agentic TTFT P50 / P90 |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for mode, r in rows.items():
        out.append(
            f"| {mode} | {f(r['cold_link_MB_per_request'], '{:.1f}')} "
            f"({f(r.get('cold_link_MB_per_request_vs_none'))}) "
            f"| {f(r['cold_wire_MB_per_request'], '{:.1f}')} "
            f"({f(r['cold_raw_MB_per_request'], '{:.1f}')}) "
            f"| {f(r['md_first_token_p_md_s_median'])} s ({r['md_first_token_p_md_n']}) "
            f"| {f(r['switch_p_rld_md_s_median'])} s ({r['switch_p_rld_md_n']}) "
            f"| {'>=' if r['cold_never_switched'] * 2 >= r['cold_requests'] else ''}"
            f"{f(r['cold_switch_s_median'])} s ({f(r.get('cold_switch_s_vs_none'))}) "
            f"| {f(r['first_cold_switch_s'])} s ({f(r.get('first_cold_switch_s_vs_none'))}) "
            f"| {f(r['agentic_ttft_p50_s'])} / {f(r['agentic_ttft_p90_s'])} s |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    rows = table(folder)
    (folder / "codec_lab.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows))
