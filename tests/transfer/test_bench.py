"""`pdd bench transfer` runs end to end and writes its JSON and plot (tiny sizes)."""

from __future__ import annotations

import json

import pytest

from pdd.bench import main as bench_main

pytestmark = pytest.mark.timeout(180)


def test_bench_transfer_writes_json_and_png(tmp_path):
    argv = ["transfer", "--transports", "tcp,ucx", "--sizes", "737280,1048576"]
    argv += ["--repeats", "2", "--cancel-bytes", str(16 << 20), "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    data = json.loads((tmp_path / "transfer.json").read_text())
    assert (tmp_path / "transfer.png").stat().st_size > 10_000
    for kind in ("tcp", "ucx"):
        rows = data["throughput"][kind]["rows"]
        assert [r["bytes"] for r in rows] == [737_280, 1_048_576]
        assert all(r["raw_stats"]["samples"] == 2 for r in rows)  # baseline in the same run
        assert data["throughput"][kind]["after_close"]["receiver"]["open_inbound"] == 0
        runs = data["cancel"][kind]["runs"]
        assert len(runs) == 3
        # 16 MiB on loopback may finish before the cancel lands: either outcome is clean
        assert {r["sender_state"] for r in runs} <= {"cancelled", "done"}
        assert {r["receiver_state"] for r in runs} <= {"cancelled", "done"}
        assert all(r["both_sides_idle"] for r in runs)
    assert "loadavg_1_5_15" in data["meta"]


def test_bench_transfer_wan_times_a_first_transfer_and_a_small_one_behind_a_large_one(tmp_path):
    argv = ["transfer", "--transports", "tcp", "--wan", "--first-bytes", str(8 << 20)]
    argv += ["--idle-s", "0.1"]
    argv += ["--behind-bytes", str(256 << 20), "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    wan = json.loads((tmp_path / "transfer.json").read_text())["wan"]["tcp"]
    assert wan["first"]["bytes"] == 8 << 20 and wan["first"]["seconds"] > 0
    warmed = wan["first_after_warm_up"]  # another new peer, warmed up first (WarmKv)
    assert warmed["warm_up_started"] and warmed["estimate_after_warm_up"]["samples"] >= 1
    assert wan["behind"]["states"] == ["done", "done"]  # both land, whole
    # the small one is not queued behind the large one: it ends with most of it still to go
    assert wan["behind"]["big_fraction_acked_when_small_done"] < 1
    assert wan["after_close"]["receiver"]["open_inbound"] == 0
