"""The pd_wan / pd_local baselines: P prefills and stages, D gets what its cache lacks and emits every
token (P's token is not shown: D samples it again), on the same fake fleet as pdd."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdd.router.text.tokenizer import TextCodec
from tests.router.conftest import PDD_POLICY, assert_released, fresh, wait_until
from tests.router.fake_kv import BLOCK_BYTES, BLOCK_SIZE
from tests.router.harness import RouterHarness
from tests.router.test_pdd_failures import (
    assert_aborted,
    assert_cancelled_kv,
    read_then_disconnect,
)
from tests.router.test_pdd_flow import MODEL, PROMPT, prompt_ids, script

DECODER = {"pd_wan": "md0", "pd_local": "dl0"}  # remote MD; the main_decode in P's dc-a


@pytest.fixture(scope="module", params=["pd_wan", "pd_local"])
def pd_harness(request, codec: TextCodec) -> Iterator[RouterHarness]:
    h = RouterHarness.pdd(codec, request.param, **PDD_POLICY)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def pd(pd_harness: RouterHarness) -> Iterator[RouterHarness]:
    fresh(pd_harness)
    yield pd_harness
    assert_released(pd_harness)


def mode(h: RouterHarness) -> str:
    assert h.cfg is not None
    return h.cfg.router.mode.value


def pd_body(pd: RouterHarness, d: str, cached_blocks: int) -> dict:
    blocks = len(prompt_ids(pd)) // BLOCK_SIZE
    wire = (blocks - cached_blocks) * BLOCK_BYTES
    return {
        "pipeline": "pd", "prompt_tokens": len(prompt_ids(pd)),
        "md_cached_tokens": cached_blocks * BLOCK_SIZE, "wan_kv_bytes": wire,
        "wan_kv_raw_bytes": wire, "rld_tokens": 0, "handoff": "none", "handoff_rounds": 0,
        "md_computed": False, "p": "p0", "rld": None, "md": d,
    }  # fmt: skip


def test_d_gets_the_blocks_its_cache_lacks_and_emits_every_token(pd):
    """As vLLM's decoder pulls only what its prefix cache lacks: D (a main_decode) holds the
    first 2 blocks of the prompt in its DRC, so P sends it the rest, D loads all of it."""
    ids = script(pd, 10)
    d = pd.by_id(DECODER[mode(pd)])
    assert d.kv.preload(prompt_ids(pd)[: 2 * BLOCK_SIZE]) == 2
    r = httpx.post(pd.url + "/completions", json={"model": MODEL, "prompt": PROMPT}, timeout=20)
    body = r.json()
    assert r.headers["x-pdd-pipeline"] == "pd"
    assert body["choices"][0]["text"] == pd.codec.decode(ids[:-1])
    assert body["usage"]["completion_tokens"] == len(ids)
    assert body["pdd"] == pd_body(pd, d.worker_id, 2)
    (p_req,) = pd.by_id("p0").requests
    assert (p_req.sampling.max_tokens, p_req.kv_stage) == (1, True)
    assert pd.by_id("p0").kv.sends == [(p_req.request_id, [(d.worker_id, 2)])]
    (d_req,) = d.requests
    assert list(d_req.prompt_token_ids) == prompt_ids(pd)  # P's token is not emitted
    assert (d_req.kv_in.source, d_req.kv_in.kv_request_id) == (2, p_req.request_id)  # DRC
    assert d.kv.awaits and d.kv.awaits[0] == p_req.request_id
    others = [f for f in pd.fakes if f.worker_id not in ("p0", d.worker_id)]
    assert all(f.requests == [] and f.kv.prepares == [] for f in others)


def test_a_prompt_d_holds_whole_sends_no_kv(pd):
    script(pd, 4)
    d = pd.by_id(DECODER[mode(pd)])
    d.kv.preload(prompt_ids(pd))
    body = httpx.post(pd.url + "/completions", json={"model": MODEL, "prompt": PROMPT},
                      timeout=20).json()  # fmt: skip
    blocks = len(prompt_ids(pd)) // BLOCK_SIZE
    assert body["pdd"] == pd_body(pd, d.worker_id, blocks)
    (p_req,) = pd.by_id("p0").requests
    assert pd.by_id("p0").kv.sends == []
    wait_until(lambda: pd.by_id("p0").kv.cancels == [(p_req.request_id, "nothing to send")],
               "P not freed")  # fmt: skip
    (d_req,) = d.requests
    assert d_req.kv_in.source == 2 and d.kv.awaits == []  # D loads its DRC, waits for nothing


def test_overrides_are_refused(pd):
    body = {"model": MODEL, "prompt": PROMPT, "pdd": {"pipeline": "p_md"}}
    r = httpx.post(pd.url + "/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "pdd"


def test_disconnect_while_d_streams(pd):
    ids = pd.codec.encode(" la di da", add_special_tokens=False)
    for f in pd.fakes:
        f.script.tokens, f.script.repeat, f.script.step_delay_s = ids, True, 0.01
    d = pd.by_id(DECODER[mode(pd)])
    read_then_disconnect(pd, "auto", chunks=3, until=lambda: d.running)
    rid = pd.by_id("p0").requests[0].request_id
    assert_aborted(pd, d.worker_id, rid)
    assert_cancelled_kv(pd, rid, ("p0", d.worker_id))
