"""The WAN between the datacenters partitions and comes back, in the lab (configs/lab.yaml:
router, P and RLD in dc-a, MD in dc-b; its own prefix and subnet, never a user's lab).

While the link is cut (a blackhole route each way: new connections fail, established ones
stall, as when a WAN router drops everything), a p_md request completes within its deadline
with the text a healthy run gives: MD's PrepareKv times out, MD counts as lost before the
first token, and a worker the router can still reach (RLD, else P) decodes the request;
nothing stays pinned, open or running anywhere once the link is back; and new requests take
MD again and succeed.
"""

from __future__ import annotations

import time

import httpx
import pytest

from pdd.config import load_config
from pdd.config.lab import LabConfig
from pdd.lab import Lab
from tests.helpers import serve, stop, wait_until
from tests.lab.support import needs_lab

pytestmark = [pytest.mark.slow, pytest.mark.lab, needs_lab]

PREFIX, SUBNET = "pdtfault", "10.77.3.0/28"
DC_A_WAN, DC_B_WAN = "10.77.3.1", "10.77.3.2"
SETS = [
    f"lab.prefix={PREFIX}", f"lab.subnet={SUBNET}", "router.health_interval_s=0.5",
    "router.worker_rpc_timeout_s=3", "router.pdd.send_kv_deadline_s=8",
    "router.pdd.await_kv_timeout_s=20", "router.pdd.kv_in_wait_s=5", "transfer.deadline_s=8",
    "cache.host_capacity_gib=0.25",  # small arenas and KV caches: the machine is shared
    *(f"workers.{i}.{key}" for i in range(3)
      for key in ("kv_staging_gib=0.2", "engine.kv_cache_space_gib=0.25")),
]  # fmt: skip
DEADLINE_S = 90  # the partitioned request's answer, error or not, comes within this
READY_S = 900


@pytest.fixture(scope="module")
def lab_serve():
    lab = Lab(LabConfig(prefix=PREFIX, subnet=SUBNET))
    lab.down()
    s = serve("configs/lab.yaml", [], SETS, timeout_s=READY_S)
    try:
        yield s, lab
    finally:
        heal(lab)
        stop(s)
        lab.down()


def blackhole(lab: Lab, verb: str) -> None:
    for dc, peer in (("dc-a", DC_B_WAN), ("dc-b", DC_A_WAN)):
        done = lab.exec(dc, ["ip", "route", verb, "blackhole", f"{peer}/32"], capture_output=True)
        assert done.returncode == 0 or verb == "del", done.stderr


def heal(lab: Lab) -> None:
    blackhole(lab, "del")


def post(url: str, prompt: str, timeout: float = DEADLINE_S) -> httpx.Response:
    body = {"model": load_config("configs/lab.yaml").model.name, "prompt": prompt,
            "max_tokens": 12, "temperature": 0, "pdd": {"pipeline": "p_md"}}  # fmt: skip
    return httpx.post(url + "/completions", json=body, timeout=timeout)


def workers(url: str) -> dict[str, dict]:
    r = httpx.get(url.removesuffix("/v1") + "/debug/workers", timeout=10)
    assert r.status_code == 200, r.text
    return {w["id"]: w for w in r.json()["workers"]}


def healthy(url: str) -> set[str]:
    body = httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json()
    return {w["id"] for w in body["workers"] if w["healthy"]}


def nothing_held(url: str) -> bool:
    ws = workers(url).values()
    return all(
        w.get("in_flight", 0) == 0
        and w.get("kv_plane", {}).get("pinned_slots", 0) == 0
        and w.get("kv_plane", {}).get("open_transfers", 0) == 0
        for w in ws
    )


def test_partitioned_wan_request_is_decoded_in_dc_a_and_service_comes_back(lab_serve):
    s, lab = lab_serve
    assert post(s.url, "The capital of France is").status_code == 200  # MD works
    prompt = " ".join(f"island{i}" for i in range(200))  # cold: P sends MD every block
    blackhole(lab, "add")
    try:
        t0 = time.monotonic()
        r = post(s.url, prompt)
        elapsed = time.monotonic() - t0
        assert elapsed < DEADLINE_S
        # MD's PrepareKv times out (router.worker_rpc_timeout_s): MD is lost before the first
        # token, gets neither KV nor the request, and RLD (else P) decodes it in dc-a
        assert r.status_code == 200, r.text
        during = r.json()
        assert during["usage"]["completion_tokens"] == 12
        assert (during["pdd"]["wan_kv_bytes"], during["pdd"]["rld_tokens"]) == (0, 11)
        wait_until(lambda: "md" not in healthy(s.url), 30, "md seen unreachable")
    finally:
        heal(lab)
    wait_until(lambda: healthy(s.url) == {"p", "rld", "md"}, 60, "md healthy again")
    wait_until(lambda: nothing_held(s.url), 60, "nothing pinned, open or running")
    after = post(s.url, prompt)
    assert after.status_code == 200, after.text
    assert during["choices"][0]["text"] == after.json()["choices"][0]["text"]
    fresh = post(s.url, "The capital of Italy is")
    assert fresh.status_code == 200 and fresh.json()["pdd"]["md"] == "md"
    wait_until(lambda: nothing_held(s.url), 60, "nothing pinned, open or running")
