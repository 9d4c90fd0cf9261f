"""Pooled TTFT of the security overhead run: every credential off vs on (docs/benchmarks.md).

    python docs/results/security/pooled.py docs/results/security/requests.jsonl.gz

Per run P50/P90; pooled over the two runs of each setting (off_1 + off_2 against on_1 + on_2);
the ratio on/off with a bootstrap 90% interval (requests resampled within each setting); the
two off runs against each other (what the host's drift alone gives); and per request, paired
by index (the same prompt in every run), the median of on/off.
"""

import gzip
import json
import random
import statistics
import sys


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> None:
    # pdd bench serve's request log: one line per request, warm-ups included
    opener = gzip.open if sys.argv[1].endswith(".gz") else open
    runs: dict[str, dict[int, float]] = {}
    with opener(sys.argv[1], "rt") as f:
        for r in map(json.loads, f):
            if r["workload"] == "agentic" and not r["warmup"] and r["error"] is None:
                runs.setdefault(r["mode"], {})[r["index"]] = r["ttft_s"]
    for name, t in runs.items():
        v = list(t.values())
        print(f"{name}: n={len(v)} P50 {pct(v, 0.5) * 1e3:.0f} ms  P90 {pct(v, 0.9) * 1e3:.0f} ms")
    off = [x for n in ("off_1", "off_2") for x in runs[n].values()]
    on = [x for n in ("on_1", "on_2") for x in runs[n].values()]
    rng = random.Random(0)
    for q, label in ((0.5, "P50"), (0.9, "P90")):
        ratio = pct(on, q) / pct(off, q)
        boots = sorted(
            pct(rng.choices(on, k=len(on)), q) / pct(rng.choices(off, k=len(off)), q)
            for _ in range(2000)
        )
        drift = pct(list(runs["off_2"].values()), q) / pct(list(runs["off_1"].values()), q)
        print(
            f"pooled {label}: off {pct(off, q) * 1e3:.0f} ms, on {pct(on, q) * 1e3:.0f} ms, "
            f"on/off {ratio:.3f} (90% interval {boots[100]:.3f}-{boots[1900]:.3f}); "
            f"off_2/off_1 {drift:.3f}"
        )
    for label, pairs in (
        ("on/off", (("off_1", "on_1"), ("off_2", "on_2"))),
        ("off_2/off_1", (("off_1", "off_2"),)),
    ):
        ratios = [runs[b][i] / runs[a][i] for a, b in pairs for i in runs[a] if i in runs[b]]
        boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        print(
            f"paired per request, median {label}: {statistics.median(ratios):.3f} "
            f"(90% interval {boots[100]:.3f}-{boots[1900]:.3f}) over {len(ratios)} pairs"
        )


if __name__ == "__main__":
    main()
