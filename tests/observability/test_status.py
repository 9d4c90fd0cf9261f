"""`pdd status` and /debug/workers against a router on fake workers whose Stats carry DRC
and WAN numbers (tests/observability/conftest.py)."""

from __future__ import annotations

import json

import httpx

from pdd.launch import free_port
from pdd.router import status
from tests.observability.conftest import MD_DRC
from tests.router.conftest import wait_until


def test_debug_workers_has_load_drc_and_wan(pdd):
    workers = {w["id"]: w for w in httpx.get(pdd.root + "/debug/workers").json()["workers"]}
    assert workers["md0"]["drc_stats"] == {
        "capacity_blocks": 4000, "used_blocks": 1000, "fill": 0.25, "query_tokens": 2000,
        "hit_tokens": 1500, "hit_rate": 0.75, "evictions": MD_DRC["drc_evictions"],
    }  # fmt: skip
    assert workers["p0"]["wan"] == {"bandwidth_bps": 93.2e6, "rtt_s": 0.0201, "links": {
        "md0": {"bandwidth_bps": 46.6e6, "rtt_s": 0.0302, "queued_bytes": 0}}}  # fmt: skip
    rld = workers["rld0"]
    assert (rld["datacenter"], rld["waiting"], rld["kv_cache_usage"]) == ("dc-a", 2, 0.25)
    assert workers["md0"]["datacenter"] == "dc-b"
    assert "drc_stats" not in rld and "wan" not in rld


def test_pdd_status_prints_each_worker(pdd, capsys):
    targets = {w["id"]: w["target"] for w in pdd.workers()}
    assert status.main(["--url", pdd.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "mode=pdd in_flight=0",
        f"  p0           prefill       {targets['p0']:<22} dc=dc-a in_flight=0 running=0 "
        "waiting=0 kv=0.0% wan=93.2Mbit/s rtt=20.1ms healthy",
        f"  rld0         relay_decode  {targets['rld0']:<22} dc=dc-a in_flight=0 running=0 "
        "waiting=2 kv=25.0% healthy",
        f"  md0          main_decode   {targets['md0']:<22} dc=dc-b in_flight=0 running=0 "
        "waiting=0 kv=0.0% drc=1000/4000(25.0%) hit=75.0%/2000tok healthy",
    ]
    assert status.main(["--url", pdd.root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "pdd"


def test_pdd_status_exit_codes(pdd, capsys):
    assert status.main(["--url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot reach the router" in capsys.readouterr().err
    for fake in pdd.fakes:
        fake.ready = False
    try:
        wait_until(lambda: not any(w["healthy"] for w in pdd.workers()), "still healthy")
        assert status.main(["--url", pdd.url]) == 1
        out = capsys.readouterr().out.splitlines()
        assert all(line.endswith("UNHEALTHY (worker reports not ready)") for line in out[1:])
    finally:
        for fake in pdd.fakes:
            fake.ready = True
