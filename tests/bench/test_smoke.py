"""`pdd bench serve --short` against a real `pdd serve --config configs/colocated.yaml`
(router + one vLLM worker, the default model): every mode completes with zero errors, the
report files exist, and the sweep's prefix hits reach the engine's cache as built."""

from __future__ import annotations

import json
import time

import pytest

from pdd.bench.serve import main
from pdd.config import load_config
from tests.helpers import serve, stop

pytestmark = pytest.mark.slow

CONFIG = "configs/colocated.yaml"
FILES = ["results.json", "requests.jsonl", "report.md", "ttft_cdf.png", "bathtub.png",
         "wan_bytes.png"]  # fmt: skip


@pytest.fixture(scope="module")
def served():
    s = serve(CONFIG, ["w0"])
    yield s
    assert stop(s) == 0, s.log_tail()


def test_short_profile_against_colocated(served, tmp_path):
    out = tmp_path / "bench"
    t0 = time.monotonic()
    code = main(["--short", "--mode", f"colocated={served.url}", "--out", str(out)])
    elapsed = time.monotonic() - t0
    print(f"bench --short took {elapsed:.1f}s")
    assert code == 0, served.log_tail()
    for name in FILES:
        assert (out / name).stat().st_size > 0, name

    data = json.loads((out / "results.json").read_text())
    assert list(data["modes"]) == ["colocated"]
    mode = data["modes"]["colocated"]
    assert mode["error"] is None
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
