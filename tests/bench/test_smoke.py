"""`pdd bench serve --short` as `make test` runs it: the benchmark starts
`pdd serve --config configs/colocated.yaml` itself (router + one vLLM worker, the default
model), runs every workload, stops it. Checks: every mode completes with zero errors, the
report files exist, the sweep's prefix hits reach the engine's cache as built, nothing is left
running.

(It starts the system through the benchmark's own mode runner rather than tests/helpers.py
``serve()``: that helper matches ``pdd ready:`` only at the start of a line, and `pdd serve`
can print a child's line into the middle of its ready line.)
"""

from __future__ import annotations

import json
import os
import time

import pytest

from pdd.bench.serve import main
from pdd.config import load_config
from tests.helpers import children_of

pytestmark = pytest.mark.slow

CONFIG = "configs/colocated.yaml"
FILES = ["results.json", "requests.jsonl", "report.md", "ttft_cdf.png", "bathtub.png",
         "wan_bytes.png", "serve-colocated.log"]  # fmt: skip


def test_short_profile_against_colocated(tmp_path):
    out = tmp_path / "bench"
    t0 = time.monotonic()
    code = main(["--short", "--out", str(out)])
    print(f"bench --short took {time.monotonic() - t0:.1f}s")
    log = (
        (out / "serve-colocated.log").read_text() if (out / "serve-colocated.log").exists() else ""
    )
    assert code == 0, log[-3000:]
    assert children_of(os.getpid()) == []
    for name in FILES:
        assert (out / name).stat().st_size > 0, name

    data = json.loads((out / "results.json").read_text())
    assert list(data["modes"]) == ["colocated"]
    mode = data["modes"]["colocated"]
    assert mode["error"] is None
    assert mode["workers"] == {"gpu_a": 1}
    assert set(mode["workloads"]) == {"agentic", "sweep"}
    for name, wl in mode["workloads"].items():
        s = wl["summary"]
        assert (s["errors"], wl["warmup_errors"], s["not_sent"]) == (0, 0, 0), s["first_errors"]
        assert s["ok"] == s["requests"] == data["workloads"][name]["measured"]
        assert s["ttft_p50_s"] > 0 and s["goodput_rps"] > 0

    # The sweep's shared prefixes land in vLLM's prefix cache, in whole blocks; a fully
    # cached prompt still computes its last token.
    block = load_config(CONFIG).engine.block_size
    length = data["config"]["sweep"]["prompt_tokens"]
    groups = mode["workloads"]["sweep"]["groups"]
    for hit in data["config"]["sweep"]["buckets"]:
        shared = min(round(hit * length), length - 1)
        expected = (shared // block) * block / length
        assert groups[f"hit={hit:g}"]["prefix_hit_rate"] == expected, hit
