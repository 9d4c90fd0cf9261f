"""/debug/requests/{id}: the timeline of a request as the router ran it (route inputs, each
worker RPC, first tokens, handoff, finish), kept for the last router.debug_requests requests;
and the request id travelling to every worker as gRPC metadata x-request-id."""

from __future__ import annotations

import httpx

from tests.observability.conftest import P_LINK
from tests.router.fake_kv import BLOCK_BYTES, BLOCK_SIZE
from tests.router.test_pdd_flow import complete, prompt_ids, relay_timing, script


def debug(h, rid: str) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.get(f"{h.root}/debug/requests/{rid}", timeout=5)


def events(view: dict, kind: str, worker: str | None = None) -> list[dict]:
    return [e for e in view["timeline"] if e["event"] == kind and worker in (None, e["worker"])]


def strip(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in ("t_ms", "duration_ms", "waited_ms")}


def test_p_rld_md_timeline(pdd):
    ids = script(pdd, 30)
    relay_timing(pdd)
    body = complete(pdd, "p_rld_md", "catch_up").json()
    rid, n = body["id"], len(prompt_ids(pdd))
    view = debug(pdd, rid).json()
    blocks = n // BLOCK_SIZE
    wan_bytes = blocks * BLOCK_BYTES
    route = {
        "pipeline": "p_rld_md",
        "workers": {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"},
        "prompt_tokens": n, "md_cached_tokens": 0, "wan_bytes": wan_bytes,
        # P's link to md0, not its best one (P_WAN)
        "eta_s": P_LINK["rtt_s"] + wan_bytes * 8 / P_LINK["bandwidth_bps"],
        "md_computes": False, "handoff": "catch_up", "block_size": BLOCK_SIZE,
    }  # fmt: skip
    assert view["route"] == route
    assert (view["request_id"], view["state"], view["finish_reason"]) == (rid, "finished", "stop")
    assert view["completion_tokens"] == len(ids) and view["sla_good"] is True
    pd = view["pdd"]
    assert pd["tokens_by_tier"]["p"] == 1 and sum(pd["tokens_by_tier"].values()) == len(ids)
    assert pd["tokens_by_tier"]["rld"] == pd["rld_tokens"] > 0
    assert (pd["handoff"], pd["kv_state"]) == ("catch_up", "done")

    times = [e["t_ms"] for e in view["timeline"]]
    assert times == sorted(times) and times[0] == 0.0
    assert [e["event"] for e in view["timeline"][:2]] == ["arrival", "route"]
    assert strip(view["timeline"][-1]) == {
        "event": "finish", "worker": None, "finish_reason": "stop", "completion_tokens": len(ids),
    }  # fmt: skip
    # Prefill on P, relay on RLD (its stream cancelled at the switch), Catch-Up warm-ups on
    # MD, then MD's own run to the end.
    (p_gen,) = events(view, "generate", "p0")
    assert strip(p_gen) == {"event": "generate", "worker": "p0", "id": rid, "prompt_tokens": n,
                            "max_tokens": 1, "outcome": "ended", "kv_stage": True}  # fmt: skip
    (rld_gen,) = events(view, "generate", "rld0")
    assert (rld_gen["kv_in"], rld_gen["outcome"], rld_gen["prompt_tokens"]) == (
        "transfer", "cancelled", n + 1,
    )  # fmt: skip
    assert rld_gen["prompt_sent"] == 1  # RLD had the prompt from PrepareKv: P's token crossed
    md_gens = events(view, "generate", "md0")
    warmups = [e["id"] for e in md_gens[:-1]]
    assert warmups == [f"{rid}.warm{i}" for i in range(1, len(md_gens))]
    assert len(md_gens) == pd["handoff_rounds"] >= 2
    assert md_gens[-1]["id"] == rid and md_gens[-1]["kv_in"] == "drc"
    # The KV plane: reservations, the dual-path send, MD's wait for the WAN transfer.
    prepared = {e["worker"]: strip(e) for e in events(view, "prepare_kv")}
    assert prepared == {
        w: {"event": "prepare_kv", "worker": w, "cached_blocks": 0, "reserved_blocks": blocks,
            "transport": t} for w, t in (("rld0", "ucx"), ("md0", "tcp"))
    }  # fmt: skip
    (send,) = events(view, "send_kv", "p0")
    assert send["destinations"] == [
        {"to": "rld0", "transport": "ucx", "first_block": 0, "bytes": wan_bytes},
        {"to": "md0", "transport": "tcp", "first_block": 0, "bytes": wan_bytes},
    ]
    (landed,) = events(view, "await_kv", "md0")
    assert (landed["state"], landed["bytes_received"], landed["blocks_ready"]) == (
        "done", wan_bytes, blocks,
    )  # fmt: skip
    assert landed["waited_ms"] >= 100  # relay_timing: MD's KV lands after 150 ms
    first = {e["worker"]: e["t_ms"] for e in events(view, "first_token")}
    assert first["p0"] <= first["rld0"] < landed["t_ms"] <= first["md0"]


def test_p_md_timeline_and_request_ids_on_every_rpc(pdd):
    script(pdd, 6)
    body = complete(pdd, "p_md").json()
    rid = body["id"]
    view = debug(pdd, rid).json()
    assert view["route"]["pipeline"] == "p_md" and view["route"]["handoff"] == "none"
    assert [e["worker"] for e in events(view, "generate")] == ["p0", "md0"]
    assert [e["worker"] for e in events(view, "first_token")] == ["p0", "md0"]
    (send,) = events(view, "send_kv")
    assert [d["to"] for d in send["destinations"]] == ["md0"]
    # Every request RPC carried the client-visible id as x-request-id.
    seen = [x for f in pdd.fakes for x in f.rpc_ids]
    assert {m for m, _, _ in seen} == {"Generate", "PrepareKv", "SendKv", "AwaitKv"}
    assert {header for _, _, header in seen} == {rid}
    assert {kv_id for _, kv_id, _ in seen} == {rid}


def test_unknown_ids_are_404_and_only_the_last_n_are_kept(pdd):
    r = debug(pdd, "cmpl-nope")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"
    script(pdd, 2)
    rids = [complete(pdd, "p_md").json()["id"] for _ in range(5)]
    assert debug(pdd, rids[0]).status_code == 404  # router.debug_requests = 4 here
    listed = httpx.get(pdd.root + "/debug/requests", timeout=5).json()["requests"]
    assert [r["request_id"] for r in listed] == rids[:0:-1]
    assert {(r["pipeline"], r["state"], r["finish_reason"]) for r in listed} == {
        ("p_md", "finished", "stop")
    }
