"""router.mode pdd failure paths: client disconnects at every stage, workers failing.

Whatever happens, every fake ends with nothing running and no KV held (the ``pdd``
fixture's teardown), and the router sends Abort / CancelKv to each worker involved.
"""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import wait_until
from tests.router.test_pdd_flow import MODEL, PROMPT, complete, prompt_ids, script


def endless(h, step_s: float = 0.01) -> None:
    ids = h.codec.encode(" la di da", add_special_tokens=False)
    for f in h.fakes:
        f.script.tokens, f.script.repeat = ids, True
        f.script.step_delay_s = step_s


def read_then_disconnect(h, pipeline, handoff="auto", *, chunks=3, until=None) -> None:
    """Stream, read ``chunks`` data lines (and until ``until()`` holds), then hang up."""
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 400,
            "pdd": {"pipeline": pipeline, "handoff": handoff}}  # fmt: skip
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", h.url + "/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen >= chunks and (until is None or until()):
                    break


def timeout_before_first_token(h, pipeline) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "pdd": {"pipeline": pipeline}}
    with httpx.Client(timeout=httpx.Timeout(10, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(h.url + "/completions", json=body)


def the_request_id(h) -> str:
    wait_until(lambda: h.by_id("p0").requests, "P never saw the request")
    return h.by_id("p0").requests[0].request_id


def assert_cancelled_kv(h, rid: str, workers: tuple[str, ...]) -> None:
    for wid in workers:
        wait_until(lambda w=wid: (rid, "aborted") in h.by_id(w).kv.cancels,
                   f"no CancelKv on {wid}")  # fmt: skip


def assert_aborted(h, worker_id: str, request_id: str) -> None:
    fake = h.by_id(worker_id)
    wait_until(lambda: request_id in fake.aborts, f"no Abort on {worker_id}")
    wait_until(lambda: fake.stream_stopped(request_id), f"{worker_id}'s stream still runs")


@pytest.mark.parametrize("pipeline", ["p_md", "p_rld_md"])
def test_disconnect_during_prefill(pdd, pipeline):
    script(pdd, 5)
    pdd.by_id("p0").script.first_delay_s = 30.0
    timeout_before_first_token(pdd, pipeline)
    rid = the_request_id(pdd)
    assert_aborted(pdd, "p0", rid)
    others = ("md0",) if pipeline == "p_md" else ("rld0", "md0")
    assert_cancelled_kv(pdd, rid, ("p0", *others))


def test_disconnect_while_rld_streams_before_md_has_kv(pdd):
    endless(pdd)
    pdd.by_id("md0").kv.land_delay_s = 30.0
    read_then_disconnect(pdd, "p_rld_md", "one_shot", chunks=4)
    rid = the_request_id(pdd)
    assert_aborted(pdd, "rld0", rid)
    assert_cancelled_kv(pdd, rid, ("p0", "rld0", "md0"))
    assert pdd.by_id("md0").requests == []


def test_disconnect_during_a_catch_up_warm_up(pdd):
    endless(pdd)
    pdd.by_id("md0").kv.land_delay_s = 0.1  # ~10 RLD tokens: a gap above the threshold (4)
    pdd.by_id("md0").script.first_delay_s = 30.0  # the warm-up round never ends
    md = pdd.by_id("md0")
    read_then_disconnect(pdd, "p_rld_md", "catch_up", chunks=3, until=lambda: md.running)
    rid = the_request_id(pdd)
    assert [r.request_id for r in md.requests] == [f"{rid}.warm1"]
    assert_aborted(pdd, "md0", f"{rid}.warm1")
    assert_aborted(pdd, "rld0", rid)
    assert_cancelled_kv(pdd, rid, ("p0", "rld0", "md0"))


@pytest.mark.parametrize("pipeline", ["p_md", "p_rld_md"])
def test_disconnect_while_md_streams(pdd, pipeline):
    endless(pdd)
    md = pdd.by_id("md0")
    read_then_disconnect(pdd, pipeline, "one_shot", chunks=3, until=lambda: md.running)
    rid = the_request_id(pdd)
    assert_aborted(pdd, "md0", rid)
    assert_cancelled_kv(pdd, rid, ("p0", "md0"))


@pytest.mark.parametrize(
    ("code", "status"), [("UNAVAILABLE", 503), ("INTERNAL", 502)]
)  # fmt: skip
def test_p_failing_before_the_first_token(pdd, code, status):
    import grpc

    script(pdd, 5)
    pdd.by_id("p0").script.fail_code = getattr(grpc.StatusCode, code)
    body = {"model": MODEL, "prompt": PROMPT, "pdd": {"pipeline": "p_rld_md"}}
    r = httpx.post(pdd.url + "/completions", json=body, timeout=10)
    assert r.status_code == status
    assert f"worker p0 Generate: {code}" in r.json()["error"]["message"]
    rid = the_request_id(pdd)
    assert_cancelled_kv(pdd, rid, ("p0", "rld0", "md0"))
    assert pdd.by_id("rld0").requests == [] and pdd.by_id("md0").requests == []


@pytest.mark.parametrize("how", ["rpc_failure", "error_finish"])
def test_md_failing_after_the_first_token_is_taken_over(pdd, how):
    """The only MD fails after P's token (at once, or after 2 tokens of its own): RLD takes
    over from prompt + emitted and the client gets the whole answer, no repeat, no gap."""
    import grpc

    ids = script(pdd, 6)
    md = pdd.by_id("md0")
    if how == "rpc_failure":
        md.script.fail_code = grpc.StatusCode.INTERNAL
    else:
        md.script.error_after = 2
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "pdd": {"pipeline": "p_md"}}
    with httpx.stream("POST", pdd.url + "/completions", json=body, timeout=10) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [httpx.Response(200, content=x[6:]).json() for x in lines[:-1]]
    assert all("error" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == pdd.codec.decode(ids[:-1])
    assert lines[-1] == "data: [DONE]"
    k = 0 if how == "rpc_failure" else 2
    takeover = pdd.by_id("rld0").requests[-1]
    assert list(takeover.prompt_token_ids) == prompt_ids(pdd) + ids[: 1 + k]
    assert chunks[-1]["pdd"]["rld_tokens"] == len(ids) - 1 - k  # the rest, with the EOS
    wait_until(lambda: (the_request_id(pdd), "worker md0 lost") in md.kv.cancels,
               "no CancelKv on the lost MD")  # fmt: skip


def test_md_lost_with_nobody_to_take_over_is_an_error_event(pdd):
    import grpc

    ids = script(pdd, 5)
    for wid in ("md0", "rld0"):
        pdd.by_id(wid).script.fail_code = grpc.StatusCode.UNAVAILABLE
    pdd.by_id("p0").script.error_after = 1  # P's own takeover fails too
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "pdd": {"pipeline": "p_md"}}
    with httpx.stream("POST", pdd.url + "/completions", json=body, timeout=10) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    first = httpx.Response(200, content=lines[0][6:]).json()
    assert first["choices"][0]["text"] == pdd.codec.decode(ids[:1])
    error = httpx.Response(200, content=lines[-2][6:]).json()
    assert "worker p0 ended request" in error["error"]["message"]
    assert lines[-1] == "data: [DONE]"
    rid, p0 = the_request_id(pdd), pdd.by_id("p0")
    wait_until(lambda: (rid, "worker p0 lost") in p0.kv.cancels, "no CancelKv on p0")


@pytest.mark.parametrize("how", ["error_finish", "rpc_failure"])
def test_rld_failing_hands_over_to_md_early(pdd, how):
    import grpc

    ids = script(pdd, 40)
    rld = pdd.by_id("rld0")
    rld.script.step_delay_s = 0.01
    if how == "error_finish":
        rld.script.error_after = 3
    else:
        rld.script.fail_code = grpc.StatusCode.UNAVAILABLE
    pdd.by_id("md0").kv.land_delay_s = 0.2
    body = complete(pdd, "p_rld_md", "one_shot").json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    k = 3 if how == "error_finish" else 0
    assert (body["pdd"]["rld_tokens"], body["pdd"]["handoff"]) == (k, "one_shot")
    final = pdd.by_id("md0").requests[-1]
    assert list(final.prompt_token_ids) == prompt_ids(pdd) + ids[: 1 + k]


def test_failed_wan_transfer_lets_md_recompute(pdd):
    ids = script(pdd, 6)
    pdd.by_id("md0").kv.fail_landing = True
    body = complete(pdd, "p_md").json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    assert body["pdd"]["pipeline"] == "p_md"
    assert len(pdd.by_id("md0").requests) == 1


@pytest.mark.parametrize("handoff", ["one_shot", "catch_up"])
def test_failed_wan_transfer_never_forces_the_switch_rld_finishes(pdd, handoff):
    """p_rld_md whose WAN transfer fails while RLD streams: no switch (MD would recompute the
    whole prompt in a stall); RLD decodes to the end and the record says why."""
    ids = script(pdd, 30)
    pdd.by_id("rld0").script.step_delay_s = 0.01  # still streaming when the transfer fails
    md = pdd.by_id("md0")
    md.kv.fail_landing = True
    body = complete(pdd, "p_rld_md", handoff).json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    assert (body["pdd"]["handoff"], body["pdd"]["rld_tokens"]) == ("rld_finished", len(ids) - 1)
    assert md.requests == []  # no Generate on MD: no warm-up, no switch
    rid = the_request_id(pdd)
    record = httpx.get(pdd.url.removesuffix("/v1") + f"/debug/requests/{rid}", timeout=5).json()
    assert record["pdd"]["kv_state"] == "failed"


def test_md_with_no_room_for_the_kv_computes_the_prompt_itself(pdd):
    """MD refuses PrepareKv (its DRC is full) after P's token is out: nothing crosses the WAN,
    MD computes the prompt from prompt + t1, and the client gets the whole answer (no 429)."""
    import grpc

    ids = script(pdd, 6)
    md = pdd.by_id("md0")
    md.prepare_fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    body = complete(pdd, "p_md").json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    assert (body["pdd"]["pipeline"], body["pdd"]["wan_kv_bytes"]) == ("p_md", 0)
    rid = the_request_id(pdd)
    assert pdd.by_id("p0").kv.sends == []
    wait_until(lambda: (rid, "nothing to send") in pdd.by_id("p0").kv.cancels, "P not freed")
    (md_req,) = md.requests
    assert list(md_req.prompt_token_ids) == prompt_ids(pdd) + ids[:1]


def test_rld_with_no_room_for_the_kv_turns_p_rld_md_into_p_md(pdd):
    """RLD refuses PrepareKv (its landing slots are full): the request goes on as p_md, whole
    and exact; RLD gets neither KV nor the request, and the record says p_md."""
    import grpc

    ids = script(pdd, 8)
    rld = pdd.by_id("rld0")
    rld.prepare_fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    r = complete(pdd, "p_rld_md", "one_shot")
    body = r.json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    assert r.headers["x-pdd-pipeline"] == "p_md"  # non-streamed: the header is the final one
    pd = body["pdd"]
    assert (pd["pipeline"], pd["rld"], pd["rld_tokens"], pd["md"]) == ("p_md", None, 0, "md0")
    rid = the_request_id(pdd)
    assert pdd.by_id("p0").kv.sends == [(rid, [("md0", 0)])]
    assert rld.requests == []
    assert list(pdd.by_id("md0").requests[-1].prompt_token_ids) == prompt_ids(pdd) + ids[:1]
