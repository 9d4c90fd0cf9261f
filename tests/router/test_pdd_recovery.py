"""router.mode pdd recovery with spares (fakes: p0, p1, rld0, md0, md1 on one KV plane).

A prefill worker lost before the first token is replaced by the other one (in the pd_wan
baseline too); a main_decode
lost mid-request is taken over by the other one from prompt + emitted. Every request ends
with the whole answer and nothing held anywhere (``assert_released``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from tests.router.conftest import PDD_POLICY, assert_released, fresh
from tests.router.fake_kv import FakeKvPlane
from tests.router.fake_worker import FakeWorker
from tests.router.harness import MAX_MODEL_LEN, RouterHarness
from tests.router.test_pdd_flow import MODEL, complete, prompt_ids, script

ROLES = {"p0": "prefill", "p1": "prefill", "rld0": "relay_decode", "md0": "main_decode",
         "md1": "main_decode"}  # fmt: skip


@pytest.fixture(scope="module")
def spares_harness(codec) -> Iterator[RouterHarness]:
    plane = FakeKvPlane()
    fakes = [FakeWorker(wid, MAX_MODEL_LEN, role, plane) for wid, role in ROLES.items()]
    policy = {**PDD_POLICY, "send_kv_deadline_s": 1.0}  # AwaitKv gives up 3 s after SendKv
    h = RouterHarness(codec, fakes, plane, mode="pdd", pdd=policy)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def spares(spares_harness) -> Iterator[RouterHarness]:
    fresh(spares_harness)
    yield spares_harness
    assert_released(spares_harness)


@pytest.mark.parametrize("code", ["UNAVAILABLE", "INTERNAL"])
def test_p_lost_before_the_first_token_is_retried_on_the_other_p(spares, code):
    ids = script(spares, 5)
    spares.by_id("p0").script.fail_code = getattr(grpc.StatusCode, code)
    for _ in range(2):
        body = complete(spares, "p_md").json()
        assert body["choices"][0]["text"] == spares.codec.decode(ids[:-1])
        assert body["pdd"]["p"] == "p1"
    assert spares.by_id("p0").requests  # it was tried, and lost


def test_both_p_lost_is_a_clear_error(spares):
    script(spares, 5)
    for wid in ("p0", "p1"):
        spares.by_id(wid).script.fail_code = grpc.StatusCode.UNAVAILABLE
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "pdd": {"pipeline": "p_md"}}
    r = httpx.post(spares.url + "/completions", json=body, timeout=10)
    assert r.status_code == 503
    assert "Generate: UNAVAILABLE" in r.json()["error"]["message"]
    assert all(spares.by_id(w).requests for w in ("p0", "p1"))


def test_md_lost_mid_request_is_taken_over_by_the_other_md(spares):
    ids = script(spares, 6)  # + EOS: P emits 1, the first MD 3 (then fails), the other 3
    for md in ("md0", "md1"):
        spares.by_id(md).script.error_after = 3
    body = complete(spares, "p_md").json()
    assert body["choices"][0]["text"] == spares.codec.decode(ids[:-1])
    asked = {m: spares.by_id(m).requests[-1] for m in ("md0", "md1")}
    second = body["pdd"]["md"]
    first = "md1" if second == "md0" else "md0"
    assert list(asked[first].prompt_token_ids) == prompt_ids(spares) + ids[:1]
    assert list(asked[second].prompt_token_ids) == prompt_ids(spares) + ids[:4]
    assert body["pdd"]["rld_tokens"] == 0


def test_kv_that_never_reaches_md_is_given_up_at_the_send_deadline(spares):
    """P's connection cut before MD saw a chunk: MD's AwaitKv would stay pending. The router
    stops waiting when P's send deadline (+2 s) passed, not at await_kv_timeout_s (10 s),
    CancelKv's MD's reservation before its Generate, and MD recomputes the prompt."""
    ids = script(spares, 5)
    for md in ("md0", "md1"):
        spares.by_id(md).kv.land_delay_s = 60.0  # the KV never arrives
    t0 = time.monotonic()
    body = complete(spares, "p_md").json()
    elapsed = time.monotonic() - t0
    assert body["choices"][0]["text"] == spares.codec.decode(ids[:-1])
    assert 3.0 <= elapsed < 6.0, elapsed
    md = spares.by_id(body["pdd"]["md"])
    rid = md.requests[-1].request_id
    assert md.kv.cancels == [(rid, "router: P's send deadline passed")]


def test_md_cut_off_after_reserving_is_left_out_and_its_reservation_released(spares):
    """MD reserves KV for the request but its PrepareKv answer never comes back in time (a
    partition right after it reserved): past worker_rpc_timeout_s (1 s) the router treats it
    as lost, sends it nothing, the other MD serves the request from the prompt, and the
    orphaned reservation is cancelled (``spares`` checks that nothing stays held)."""
    ids = script(spares, 5)
    for md in ("md0", "md1"):
        spares.by_id(md).prepare_delay_s = 3.0
    t0 = time.monotonic()
    body = complete(spares, "p_md").json()
    elapsed = time.monotonic() - t0
    assert body["choices"][0]["text"] == spares.codec.decode(ids[:-1])
    cut_off = [m for m in ("md0", "md1") if spares.by_id(m).kv.prepares]
    assert len(cut_off) == 1 and body["pdd"]["md"] != cut_off[0]
    assert not spares.by_id(cut_off[0]).requests  # no Generate to the lost MD
    assert body["pdd"]["wan_kv_bytes"] == 0
    assert elapsed < 3.0, elapsed  # did not wait for the late answer


def test_md_cut_off_while_its_generate_waits_for_the_kv_is_taken_over(spares):
    """MD's Generate waits on MD for its KV (sent before it landed); then MD is cut off: its
    AwaitKv answers past worker_rpc_timeout_s (1 s). The router does not wait for the
    Generate's own deadline: it treats MD as lost, another worker continues prompt + t1,
    and nothing stays held."""
    ids = script(spares, 5)
    for md in ("md0", "md1"):
        spares.by_id(md).kv.land_delay_s = 30.0
    spares.by_id("md0").await_delay_s = spares.by_id("md1").await_delay_s = 30.0
    t0 = time.monotonic()
    body = complete(spares, "p_md").json()
    elapsed = time.monotonic() - t0
    assert body["choices"][0]["text"] == spares.codec.decode(ids[:-1])
    waited = [m for m in ("md0", "md1") if spares.by_id(m).kv.waits]
    assert len(waited) == 1  # the first MD's Generate was waiting there
    rid = spares.by_id("p0").requests[0].request_id
    assert spares.by_id(waited[0]).cancelled == [rid]  # its stream was closed
    assert elapsed < 10.0, elapsed  # not the 30 s the KV or the AwaitKv would take


@pytest.fixture(scope="module")
def pd_spares(codec) -> Iterator[RouterHarness]:
    """The same fleet serving the pd_wan baseline (D: a main_decode)."""
    plane = FakeKvPlane()
    fakes = [FakeWorker(wid, MAX_MODEL_LEN, role, plane) for wid, role in ROLES.items()]
    h = RouterHarness(codec, fakes, plane, mode="pd_wan", pdd=PDD_POLICY)
    h.start()
    fresh(h)
    yield h
    h.stop()


def test_the_pd_baseline_retries_a_lost_p_on_the_other_p_too(pd_spares):
    ids = script(pd_spares, 5)
    pd_spares.by_id("p0").script.fail_code = grpc.StatusCode.UNAVAILABLE
    for _ in range(2):
        r = httpx.post(pd_spares.url + "/completions", json={"model": MODEL, "prompt": "x y z"},
                       timeout=20)  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == pd_spares.codec.decode(ids[:-1])
        assert r.json()["pdd"]["p"] == "p1"
    assert pd_spares.by_id("p0").requests  # it was tried, and lost
    assert_released(pd_spares)
