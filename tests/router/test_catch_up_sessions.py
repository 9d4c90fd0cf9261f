"""Catch-Up with MD sessions (router.pdd.catch_up_sessions) and at least one warm-up
(min_catch_up_rounds), through the HTTP API with fake P / RLD / MD workers.

What the router asks of MD: the warm-ups open and continue one session (its id the request's
kv id, kept open), the switch continues and ends it; a handoff that never switches ends it
with Abort(id). MD's side (the engine keeps the KV) is tested on a real engine in
tests/main_decode/test_md_sessions.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.router.conftest import PDD_POLICY, assert_released, fresh, wait_until
from tests.router.harness import RouterHarness
from tests.router.test_pdd_flow import (
    assert_handoff_stream,
    complete,
    gen_requests,
    relay_timing,
    script,
)


@pytest.fixture(scope="module")
def harness(codec) -> Iterator[RouterHarness]:
    h = RouterHarness.pdd(codec, "pdd", **PDD_POLICY, min_catch_up_rounds=1)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def pdd(harness: RouterHarness) -> Iterator[RouterHarness]:
    fresh(harness)
    yield harness
    assert_released(harness)


def test_catch_up_warms_md_up_once_even_when_the_gap_is_small(pdd):
    """MD's KV lands while RLD has emitted fewer tokens than catch_up_threshold_tokens (4):
    one warm-up still runs first (min_catch_up_rounds 1: it loads the prompt's KV into MD's
    engine while RLD streams), then the switch continues from what RLD emitted meanwhile.
    Both are one session on MD: the warm-up keeps it open, the switch ends it."""
    ids = script(pdd, 40)
    relay_timing(pdd, rld_step=0.05, md_land=0.02)  # KV lands before RLD's second token
    pdd.by_id("md0").script.first_delay_s = 0.12  # RLD emits ~2 more during the warm-up
    body = complete(pdd, "p_rld_md", "catch_up").json()
    assert (body["pdd"]["handoff"], body["pdd"]["handoff_rounds"]) == ("catch_up", 2)
    assert_handoff_stream(pdd, ids, body, rounds_at_least=2)
    warm, final = gen_requests(pdd, "md0")
    assert warm.request_id.endswith(".warm1") and warm.sampling.max_tokens == 1
    assert len(warm.prompt_token_ids) < len(final.prompt_token_ids)
    kv_id = final.request_id
    assert (warm.session.id, warm.session.keep) == (kv_id, True)
    assert (final.session.id, final.session.keep) == (kv_id, False)
    assert kv_id not in pdd.by_id("md0").aborts  # ended by its last call, not by an Abort


def test_a_handoff_that_never_switches_ends_md_s_session(pdd):
    """RLD finishes the request during MD's second warm-up: MD holds the session the first
    one opened, which nobody will continue, and the router ends it (Abort with the
    session's id) instead of leaving it to expire."""
    ids = script(pdd, 40)
    relay_timing(pdd, rld_step=0.03, md_land=0.02)  # RLD's 19 tokens end ~0.6 s in
    pdd.by_id("md0").script.first_delay_s = 0.4  # each warm-up: RLD emits ~13 meanwhile
    body = complete(pdd, "p_rld_md", "catch_up", max_tokens=20).json()
    assert body["pdd"]["rld_tokens"] == 19  # P's token, then RLD's to the end
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:20])
    warm = gen_requests(pdd, "md0")[0]
    assert all(r.session.keep for r in gen_requests(pdd, "md0"))
    wait_until(lambda: warm.session.id in pdd.by_id("md0").aborts, "MD's session not ended")
