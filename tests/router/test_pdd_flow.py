"""router.mode pdd through the HTTP API with fake P / RLD / MD workers.

Each fake checks that what it continues is exactly the prompt plus the tokens emitted
before (``FakeWorker.violations``); the ``pdd`` fixture checks afterwards that no fake runs
anything or holds KV. Token streams are compared exactly: no repeats, no gaps.
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.router.conftest import wait_until
from tests.router.fake_kv import BLOCK_BYTES, BLOCK_SIZE
from tests.router.fake_worker import EOS

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The quick brown fox jumps over the lazy dog near the river bank today"


def script(h, n: int = 30, *, eos: bool = True) -> list[int]:
    """The same 'model output' on every fake: n distinct tokens (then EOS)."""
    ids = h.codec.encode("".join(f" w{i}" for i in range(200)), add_special_tokens=False)[:n]
    ids = ids + ([EOS] if eos else [])
    for f in h.fakes:
        f.script.tokens = list(ids)
    return ids


def prompt_ids(h) -> list[int]:
    return h.codec.encode(PROMPT)


def complete(h, pipeline="auto", handoff="auto", **body):
    payload = {"model": MODEL, "prompt": PROMPT, "pdd": {"pipeline": pipeline, "handoff": handoff}}
    r = httpx.post(h.url + "/completions", json={**payload, **body}, timeout=20)
    assert r.status_code == 200, r.text
    return r


def stream_tokens(h, pipeline, handoff="auto", **body):
    """(concatenated text, final chunk, header) of a streamed completion."""
    payload = {"model": MODEL, "prompt": PROMPT, "stream": True,
               "pdd": {"pipeline": pipeline, "handoff": handoff}, **body}  # fmt: skip
    chunks = []
    with httpx.stream("POST", h.url + "/completions", json=payload, timeout=20) as r:
        assert r.status_code == 200
        header = r.headers["x-pdd-pipeline"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(httpx.Response(200, content=line[6:]).json())
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks, header


def gen_requests(h, worker_id):
    return h.by_id(worker_id).requests


def test_p_md_exact_stream_and_record(pdd):
    ids = script(pdd, 12)
    r = complete(pdd, "p_md")
    body = r.json()
    n_prompt = len(prompt_ids(pdd))
    blocks = n_prompt // BLOCK_SIZE
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    assert body["usage"]["completion_tokens"] == len(ids)
    assert r.headers["x-pdd-pipeline"] == "p_md"
    assert body["pdd"] == {
        "pipeline": "p_md", "prompt_tokens": n_prompt, "md_cached_tokens": 0,
        "wan_kv_bytes": blocks * BLOCK_BYTES, "wan_kv_raw_bytes": blocks * BLOCK_BYTES,
        "rld_tokens": 0, "handoff": "none",
        "handoff_rounds": 0, "md_computed": False, "p": "p0", "rld": None, "md": "md0",
    }  # fmt: skip
    (p_req,) = gen_requests(pdd, "p0")
    assert (p_req.sampling.max_tokens, p_req.kv_stage) == (1, True)
    (md_req,) = gen_requests(pdd, "md0")
    assert list(md_req.prompt_token_ids) == prompt_ids(pdd) + ids[:1]
    assert md_req.sampling.max_tokens == pdd.cfg.engine.max_model_len - n_prompt - 1
    assert (p_req.sampling.prior_output_tokens, md_req.sampling.prior_output_tokens) == (0, 1)
    assert (md_req.kv_in.source, md_req.kv_in.kv_request_id) == (2, p_req.request_id)
    assert pdd.by_id("p0").kv.sends == [(p_req.request_id, [("md0", 0)])]
    assert gen_requests(pdd, "rld0") == [] and pdd.by_id("rld0").kv.prepares == []


def test_p_md_generate_reaches_md_before_its_kv_and_waits_there(pdd):
    """No AwaitKv round trip before MD's Generate: it is sent once P's send started, waits on
    MD while the KV crosses, and MD answers once it landed; the router follows the landing
    alongside (the record says it was done)."""
    ids = script(pdd, 6)
    md = pdd.by_id("md0")
    md.kv.land_delay_s = 0.5
    body = complete(pdd, "p_md").json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    rid = gen_requests(pdd, "p0")[0].request_id
    assert md.kv.waits == [rid]  # the Generate was there while the KV was on its way
    assert md.kv.awaits and md.kv.cancels == []
    record = httpx.get(pdd.url.removesuffix("/v1") + f"/debug/requests/{rid}", timeout=5).json()
    assert record["pdd"]["kv_state"] == "done"


def test_kv_wait_await_first_sends_md_its_generate_after_the_kv_landed(pdd):
    """The older flow, kept for same-run comparisons (``"pdd": {"kv_wait": "await_first"}``):
    AwaitKv answers, then MD's Generate is sent, and finds its KV there."""
    ids = script(pdd, 6)
    md = pdd.by_id("md0")
    md.kv.land_delay_s = 0.5
    body = complete(pdd, "p_md", pdd={"pipeline": "p_md", "kv_wait": "await_first"}).json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    assert md.kv.awaits and md.kv.waits == []  # it never waited on MD


def test_p_md_sends_only_what_md_lacks(pdd):
    ids = script(pdd, 5)
    md = pdd.by_id("md0")
    cached_blocks = md.kv.preload(prompt_ids(pdd)[: 2 * BLOCK_SIZE])
    assert cached_blocks == 2
    body = complete(pdd, "p_md").json()
    blocks = len(prompt_ids(pdd)) // BLOCK_SIZE
    assert body["pdd"]["md_cached_tokens"] == 2 * BLOCK_SIZE
    assert body["pdd"]["wan_kv_bytes"] == (blocks - 2) * BLOCK_BYTES
    rid = gen_requests(pdd, "p0")[0].request_id
    assert pdd.by_id("p0").kv.sends == [(rid, [("md0", 2)])]
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])


def test_p_md_full_hit_sends_nothing_and_releases_p(pdd):
    script(pdd, 3)
    pdd.by_id("md0").kv.preload(prompt_ids(pdd))
    body = complete(pdd, "p_md").json()
    assert (body["pdd"]["wan_kv_bytes"], body["pdd"]["md_cached_tokens"]) == (
        0, len(prompt_ids(pdd)) // BLOCK_SIZE * BLOCK_SIZE,
    )  # fmt: skip
    rid = gen_requests(pdd, "p0")[0].request_id
    assert pdd.by_id("p0").kv.sends == []
    wait_until(lambda: pdd.by_id("p0").kv.cancels == [(rid, "nothing to send")], "P not freed")
    assert pdd.by_id("md0").kv.awaits == []


def relay_timing(h, *, rld_step=0.01, md_land=0.15):
    h.by_id("rld0").script.step_delay_s = rld_step
    h.by_id("md0").kv.land_delay_s = md_land


def assert_handoff_stream(h, ids, body, rounds_at_least=1):
    """Text exact; P gave 1 token, RLD k, MD the rest, MD continued prompt + the k+1."""
    pd = body["pdd"]
    assert body["choices"][0]["text"] == h.codec.decode(ids[:-1])
    assert body["usage"]["completion_tokens"] == len(ids)
    k = pd["rld_tokens"]
    md_final = gen_requests(h, "md0")[-1]
    assert list(md_final.prompt_token_ids) == prompt_ids(h) + ids[: 1 + k]
    assert md_final.sampling.prior_output_tokens == 1 + k  # penalties count what was emitted
    assert md_final.request_id == gen_requests(h, "p0")[0].request_id
    assert pd["handoff_rounds"] >= rounds_at_least
    rld_req = gen_requests(h, "rld0")[0]
    assert list(rld_req.prompt_token_ids) == prompt_ids(h) + ids[:1]
    assert rld_req.kv_in.source == 1  # TRANSFER


def test_an_rld_without_room_for_the_kv_is_not_picked(pdd):
    """A cold request would go p_rld_md (the fakes' WAN is slow), but RLD's Stats say its
    landing arena has no room for the prompt's blocks: the router sends it p_md, and RLD is
    never asked for a reservation it would refuse."""
    ids = script(pdd, 6)
    blocks = len(prompt_ids(pdd)) // BLOCK_SIZE
    rld = pdd.by_id("rld0")
    rld.kv_arena_blocks, rld.kv_free_blocks = blocks + 4, blocks - 1
    workers_url = pdd.url.removesuffix("/v1") + "/debug/workers"

    def seen() -> bool:
        rows = httpx.get(workers_url, timeout=5).json()["workers"]
        return any(w["id"] == "rld0" and w.get("kv_plane", {}).get("free_blocks") == blocks - 1
                   for w in rows)  # fmt: skip

    try:
        wait_until(seen, "the router never saw RLD's Stats")
        body = complete(pdd).json()
        assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
        assert (body["pdd"]["pipeline"], body["pdd"]["rld"]) == ("p_md", None)
        assert rld.kv.prepares == [] and gen_requests(pdd, "rld0") == []
        rld.kv_free_blocks = blocks + 4  # room again: a cold request goes p_rld_md
        wait_until(lambda: not seen(), "the router never saw RLD's room")
        other = " ".join(reversed(PROMPT.split()))  # cold: MD holds the first prompt now
        assert complete(pdd, prompt=other).json()["pdd"]["pipeline"] == "p_rld_md"
    finally:
        rld.kv_arena_blocks = rld.kv_free_blocks = 0


def test_p_rld_md_one_shot(pdd):
    ids = script(pdd, 60)
    relay_timing(pdd)
    r = complete(pdd, "p_rld_md", "one_shot")
    body = r.json()
    assert r.headers["x-pdd-pipeline"] == "p_rld_md"
    pd = body["pdd"]
    assert (pd["pipeline"], pd["handoff"], pd["handoff_rounds"]) == ("p_rld_md", "one_shot", 1)
    assert (pd["p"], pd["rld"], pd["md"]) == ("p0", "rld0", "md0")
    assert 0 < pd["rld_tokens"] < len(ids) - 1
    assert_handoff_stream(pdd, ids, body)
    rid = gen_requests(pdd, "p0")[0].request_id
    assert len(gen_requests(pdd, "md0")) == 1
    assert pdd.by_id("p0").kv.sends == [(rid, [("rld0", 0), ("md0", 0)])]
    wait_until(lambda: rid in pdd.by_id("rld0").aborts, "RLD was not aborted at the switch")
    assert pdd.by_id("rld0").kv.cancels == [(rid, "handed off to MD")]
    assert pdd.by_id("md0").kv.cancels == [] and pdd.by_id("p0").kv.cancels == []


def test_p_rld_md_catch_up_rounds(pdd):
    ids = script(pdd, 80)
    relay_timing(pdd, rld_step=0.01, md_land=0.1)
    pdd.by_id("md0").script.first_delay_s = 0.03  # each MD round takes ~3 RLD tokens
    body = complete(pdd, "p_rld_md", "catch_up").json()
    pd = body["pdd"]
    assert (pd["handoff"], pd["pipeline"]) == ("catch_up", "p_rld_md")
    assert_handoff_stream(pdd, ids, body, rounds_at_least=2)
    md_reqs = gen_requests(pdd, "md0")
    warm, final = md_reqs[:-1], md_reqs[-1]
    assert len(warm) == pd["handoff_rounds"] - 1 >= 1
    assert [w.request_id.rsplit(".", 1)[1] for w in warm] == [
        f"warm{i + 1}" for i in range(len(warm))
    ]
    assert all(w.sampling.max_tokens == 1 and w.kv_in.source == 2 for w in warm)
    lengths = [len(w.prompt_token_ids) for w in warm] + [len(final.prompt_token_ids)]
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
    # The switch happens once fewer than catch_up_threshold_tokens (4) are missing on MD,
    # unless the round limit hit first.
    gap = len(final.prompt_token_ids) - len(warm[-1].prompt_token_ids)
    assert gap < 4 or len(warm) == 8


def test_the_prompt_crosses_to_rld_and_md_once(pdd):
    """PrepareKv brings RLD and MD the prompt; every Generate after it (RLD's, each Catch-Up
    warm-up, the switch) refers to it and carries only the tokens emitted since."""
    ids = script(pdd, 80)
    relay_timing(pdd, rld_step=0.01, md_land=0.1)
    pdd.by_id("md0").script.first_delay_s = 0.03
    body = complete(pdd, "p_rld_md", "catch_up").json()
    assert_handoff_stream(pdd, ids, body, rounds_at_least=2)
    n = len(prompt_ids(pdd))
    for wid in ("rld0", "md0"):
        fake, reqs = pdd.by_id(wid), gen_requests(pdd, wid)
        assert len(reqs) >= 1 and all(r.prompt_ref.tokens == n for r in reqs), wid
        # what crossed: the emitted tokens only (the fake rebuilt each whole prompt)
        assert fake.sent_prompt_tokens == [len(r.prompt_token_ids) - n for r in reqs], wid
        assert fake.refused_refs == 0


def test_a_worker_that_lost_the_prompt_gets_it_whole(pdd):
    """MD no longer holds the prompt (e.g. it restarted after PrepareKv): it refuses the
    reference before starting, and the router sends that Generate with the prompt whole."""
    ids = script(pdd, 12)
    md = pdd.by_id("md0")
    md.forget_prompts = True
    body = complete(pdd, "p_md").json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    assert md.refused_refs == 1
    (md_req,) = gen_requests(pdd, "md0")  # the refused call never started
    assert not md_req.HasField("prompt_ref")
    assert list(md_req.prompt_token_ids) == prompt_ids(pdd) + ids[:1]


def test_anomaly_rld_finishes_first_and_md_s_kv_still_lands_for_the_next_turn(pdd):
    """RLD ends the request before MD's KV landed: the client has every token from RLD, and
    the WAN transfer is not cut but left to finish in the background (CancelKv(background)
    on P and MD), so MD's DRC holds the prompt when the transfer ends and releases its
    reservation by itself."""
    ids = script(pdd, 6)
    relay_timing(pdd, rld_step=0.001, md_land=1.0)
    body = complete(pdd, "p_rld_md", "one_shot").json()
    pd = body["pdd"]
    assert (pd["handoff"], pd["handoff_rounds"], pd["rld_tokens"]) == (
        "rld_finished", 0, len(ids) - 1,
    )  # fmt: skip
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    assert body["choices"][0]["finish_reason"] == "stop"
    rid = gen_requests(pdd, "p0")[0].request_id
    assert gen_requests(pdd, "md0") == []
    md = pdd.by_id("md0").kv
    for wid in ("p0", "md0"):
        wait_until(lambda w=wid: rid in pdd.by_id(w).kv.deferred, f"no deferral on {wid}")
        assert pdd.by_id(wid).kv.cancels == []
    wait_until(lambda: md.final_states.get(rid) == "done", "MD's KV never landed")
    blocks = len(prompt_ids(pdd)) // BLOCK_SIZE
    assert len(md.drc) == blocks
    root = pdd.url.removesuffix("/v1")
    assert httpx.get(f"{root}/debug/requests/{body['id']}").json()["pdd"]["kv_deferred"] is True
    deferred = re.search(r"^pdd_kv_deferred_total (\S+)$", httpx.get(f"{root}/metrics").text, re.M)
    assert deferred is not None and float(deferred.group(1)) >= 1


def test_a_one_off_request_cuts_the_wan_transfer_when_rld_finishes_first(pdd):
    """A request marked "pdd": {"one_off": true} (any key may send it): its prefix will not be reused, so
    RLD finishing first cancels MD's transfer on P and MD."""
    ids = script(pdd, 6)
    relay_timing(pdd, rld_step=0.001, md_land=30.0)
    body = complete(pdd, "p_rld_md", "one_shot", pdd={"pipeline": "p_rld_md",
                                                      "one_off": True}).json()  # fmt: skip
    assert (body["pdd"]["handoff"], body["pdd"]["rld_tokens"]) == ("rld_finished", len(ids) - 1)
    rid = gen_requests(pdd, "p0")[0].request_id
    for wid in ("p0", "md0"):
        wait_until(lambda w=wid: (rid, "rld_finished") in pdd.by_id(w).kv.cancels,
                   f"no CancelKv on {wid}")  # fmt: skip
        assert pdd.by_id(wid).kv.deferred == []
    assert pdd.by_id("md0").kv.final_states[rid] == "cancelled"


def test_the_next_turn_to_md_supersedes_a_transfer_still_landing_in_the_background(pdd):
    """A deferred transfer still on its way when a request extending its prompt reaches the
    same MD is cancelled (on P and MD) before that request's PrepareKv: the new transfer
    carries the blocks, so they do not cross twice."""
    script(pdd, 6)
    relay_timing(pdd, rld_step=0.001, md_land=30.0)
    first = complete(pdd, "p_rld_md", "one_shot").json()
    assert first["pdd"]["handoff"] == "rld_finished"
    rid = gen_requests(pdd, "p0")[0].request_id
    wait_until(lambda: rid in pdd.by_id("md0").kv.deferred, "no deferral on md0")
    relay_timing(pdd, rld_step=0.001, md_land=0.05)
    longer = PROMPT + " and then it rested for a while under the old oak tree"
    second = complete(pdd, "p_md", prompt=longer).json()
    assert second["pdd"]["pipeline"] == "p_md"
    why = f"superseded by request {gen_requests(pdd, 'p0')[1].request_id}"
    for wid in ("p0", "md0"):
        wait_until(lambda w=wid: (rid, why) in pdd.by_id(w).kv.cancels,
                   f"{wid}: the deferred transfer was not cancelled")  # fmt: skip
    assert pdd.by_id("md0").kv.final_states[rid] == "cancelled"


def test_anomaly_by_max_tokens(pdd):
    ids = script(pdd, 40)
    relay_timing(pdd, rld_step=0.001, md_land=1.0)
    body = complete(pdd, "p_rld_md", max_tokens=5).json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:5])
    assert body["choices"][0]["finish_reason"] == "length"
    assert (body["pdd"]["handoff"], body["pdd"]["rld_tokens"]) == ("rld_finished", 4)
    assert gen_requests(pdd, "rld0")[0].sampling.max_tokens == 4


def test_streamed_handoff_is_exact_and_the_final_chunk_has_the_record(pdd):
    ids = script(pdd, 50)
    relay_timing(pdd)
    text, chunks, header = stream_tokens(pdd, "p_rld_md", "one_shot")
    assert header == "p_rld_md"
    assert text == pdd.codec.decode(ids[:-1])
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0] is chunks[-1]
    assert final[0]["pdd"]["handoff"] == "one_shot"
    assert all("pdd" not in c for c in chunks[:-1])


def test_eos_from_p_finishes_on_p_and_cancels_everything(pdd):
    for f in pdd.fakes:
        f.script.tokens = [EOS]
    body = complete(pdd, "p_rld_md").json()
    assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == ("stop", 1)
    assert body["pdd"]["rld_tokens"] == 0 and body["pdd"]["handoff_rounds"] == 0
    rid = gen_requests(pdd, "p0")[0].request_id
    for wid in ("p0", "rld0", "md0"):
        wait_until(lambda w=wid: pdd.by_id(w).kv.cancels == [(rid, "finished on P")],
                   f"no CancelKv on {wid}")  # fmt: skip
    assert gen_requests(pdd, "rld0") == [] and gen_requests(pdd, "md0") == []


def test_max_tokens_one_is_served_by_p_alone(pdd):
    ids = script(pdd, 5)
    body = complete(pdd, "p_md", max_tokens=1).json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:1])
    assert body["choices"][0]["finish_reason"] == "length"
    assert gen_requests(pdd, "md0") == []


def test_stop_string_on_md_ends_the_request(pdd):
    ids = script(pdd, 20)
    stop = pdd.codec.decode(ids[3:5]).strip()
    body = complete(pdd, "p_md", stop=[stop]).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert stop not in body["choices"][0]["text"]
    assert body["pdd"]["pipeline"] == "p_md"


def test_auto_routing_follows_the_md_cache_view(pdd):
    """A miss goes p_rld_md (the WAN is slow); its KV lands in MD's DRC; the router's view
    learns it from DrcEvents, and the same prompt then goes p_md."""
    ids = script(pdd, 8)  # P's WAN estimate (harness): 1 s per block, over the 0.5 s budget
    relay_timing(pdd, rld_step=0.05, md_land=0.05)
    first = complete(pdd).json()
    assert (first["pdd"]["pipeline"], first["pdd"]["handoff"]) == ("p_rld_md", "catch_up")
    pdd.wait_drc_synced()
    second = complete(pdd).json()
    assert second["pdd"]["pipeline"] == "p_md"
    assert second["pdd"]["wan_kv_bytes"] == 0
    assert second["choices"][0]["text"] == pdd.codec.decode(ids[:-1])


def test_auto_handoff_mode_follows_rld_load(pdd):
    script(pdd, 30)
    relay_timing(pdd, md_land=0.05)
    try:
        pdd.by_id("rld0").stats_running = 5  # 5 of max_num_seqs 8: above 0.5
        wait_until(lambda: _running(pdd, "rld0") >= 5, "stats not polled")
        assert complete(pdd).json()["pdd"]["handoff"] == "one_shot"
        pdd.by_id("rld0").stats_running = 8  # full: no RLD capacity -> p_md
        wait_until(lambda: _running(pdd, "rld0") >= 8, "stats not polled")
        assert complete(pdd).json()["pdd"]["pipeline"] == "p_md"
    finally:
        pdd.by_id("rld0").stats_running = 0


def _running(h, worker_id):
    return next(w["running"] for w in h.workers() if w["id"] == worker_id)


def test_openai_client_sees_the_record_as_an_extra_field(pdd):
    ids = script(pdd, 4)
    client = openai.OpenAI(base_url=pdd.url, api_key="x", max_retries=0, timeout=20)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}],
        extra_body={"pdd": {"pipeline": "p_md"}},
    )  # fmt: skip
    assert r.choices[0].message.content == pdd.codec.decode(ids[:-1])
    assert r.model_extra["pdd"]["pipeline"] == "p_md"


@pytest.mark.parametrize(
    ("pdd_body", "param"),
    [
        ({"pipeline": "p_rld"}, "pdd.pipeline"),
        ({"handoff": "slow"}, "pdd.handoff"),
        ({"kv_wait": "never"}, "pdd.kv_wait"),
    ],
)
def test_bad_overrides_are_400(pdd, pdd_body, param):
    body = {"model": MODEL, "prompt": PROMPT, "pdd": pdd_body}
    r = httpx.post(pdd.url + "/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    r = httpx.post(pdd.url + "/completions", json={**body, "pdd": {"pipline": "p_md"}})
    assert r.status_code == 422


def test_pdd_metrics(pdd):
    script(pdd, 30)
    relay_timing(pdd)
    complete(pdd, "p_rld_md", "one_shot")
    text = httpx.get(pdd.root + "/metrics").text
    assert 'pdd_route_decisions_total{pipeline="p_rld_md"}' in text
    assert 'pdd_handoffs_total{mode="one_shot"}' in text
    assert 'pdd_handoff_rounds_bucket{le="1.0",mode="one_shot"}' in text
    assert 'pdd_handoff_stall_seconds_count{mode="one_shot"}' in text
    for tier in ("p", "rld", "md"):
        assert f'pdd_output_tokens_total{{tier="{tier}"}}' in text
    assert 'pdd_wan_kv_bytes_total{pipeline="p_rld_md"}' in text
    assert 'pdd_time_to_first_token_seconds_count{pipeline="p_rld_md"}' in text


def test_prompt_shorter_than_a_block_sends_nothing(pdd):
    ids = script(pdd, 30)
    relay_timing(pdd)
    body = {"model": MODEL, "prompt": [5, 6, 7], "pdd": {"pipeline": "p_rld_md"}}
    r = httpx.post(pdd.url + "/completions", json=body, timeout=20).json()
    assert r["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    assert r["pdd"]["wan_kv_bytes"] == 0
    rid = gen_requests(pdd, "p0")[0].request_id
    assert pdd.by_id("p0").kv.sends == []
    for wid in ("p0", "rld0"):
        wait_until(lambda w=wid: pdd.by_id(w).kv.cancels == [(rid, "nothing to send")],
                   f"no CancelKv on {wid}")  # fmt: skip
    assert not gen_requests(pdd, "rld0") or not gen_requests(pdd, "rld0")[0].HasField("kv_in")


def test_p_is_asked_once_to_warm_up_its_links_to_each_receiver(pdd):
    """Before any request needs them, the router has P open and measure its KV links to every
    receiver (WarmKv, named from their Stats): once per pair, not at every health poll, and
    again for a P that restarted (its links are gone)."""
    import time

    p0 = pdd.by_id("p0")
    named = lambda: sorted(n for call in p0.warm_calls for n in call)  # noqa: E731
    wait_until(lambda: named() == ["md0", "rld0"], f"P was not named its receivers: {named()}")
    time.sleep(10 * 0.05)  # ten more health polls (router.health_interval_s 0.05)
    assert named() == ["md0", "rld0"]
    p0.instance_id = "second-process"  # P restarted
    wait_until(lambda: named() == ["md0", "md0", "rld0", "rld0"], "a restarted P was not named")


@pytest.mark.parametrize(
    ("pipeline", "handoff"), [("p_md", "auto"), ("p_rld_md", "one_shot"), ("p_rld_md", "catch_up")]
)
def test_echo_and_prompt_logprobs_come_from_p_alone(pdd, pipeline, handoff):
    """P computes the whole prompt, so only P's Generate asks for the prompt's logprobs (a
    tier that loads KV would refuse them; the fakes count it as a violation); the client gets
    P's, before the tokens of every tier."""
    ids = script(pdd, 12)
    n = len(prompt_ids(pdd))
    r = complete(pdd, pipeline, handoff, echo=True, logprobs=0, max_tokens=20)
    choice = r.json()["choices"][0]
    assert choice["text"] == PROMPT + pdd.codec.decode(ids[:-1])
    assert choice["logprobs"]["token_logprobs"] == [None] + [-1.0] * (n - 1) + [-0.5] * len(ids)
    asked = [f.worker_id for f in pdd.fakes for q in f.requests
             if q.sampling.HasField("prompt_logprobs")]  # fmt: skip
    assert asked == ["p0"]
    body = complete(pdd, pipeline, handoff, prompt_logprobs=1, max_tokens=20).json()
    positions = body["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == n
    own = [p[str(t)]["logprob"] for p, t in zip(positions[1:], prompt_ids(pdd)[1:], strict=True)]
    assert own == [-1.0] * (n - 1)


def test_several_choices_each_run_the_whole_pipeline(pdd):
    """n=2 on p_rld_md: each choice is a request of its own through P, RLD and MD (its own
    KV id), both answers whole; the fixture then checks nothing is left held."""
    ids = script(pdd, 12)
    body = complete(pdd, "p_rld_md", "one_shot", n=2).json()
    assert [c["text"] for c in body["choices"]] == [pdd.codec.decode(ids[:-1])] * 2
    assert [c["pdd"]["pipeline"] for c in body["choices"]] == ["p_rld_md"] * 2
    p_reqs = gen_requests(pdd, "p0")
    assert len({q.request_id for q in p_reqs}) == 2
    assert body["usage"]["completion_tokens"] == 2 * len(ids)
