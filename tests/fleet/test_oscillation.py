"""No oscillation: a burst of low-hit (cold) requests, then normal multi-turn traffic, on
running routers over a fake fleet (2 P, 2 RLD, 2 MD on one fake KV plane).

Under the PDD policy every request ends on MD, so the cold burst lands in MD's DRC (the WAN
transfer commits it) and the follow-ups hit on MD as much as on P: MD's hit rate tracks P's,
the follow-ups go p_md and RLD stays idle. The same scenario under the TEST-ONLY
``router.pdd.test_policy: p_rld_only`` (P -> RLD, RLD finishes) never warms MD: MD's hit rate
collapses while P's stays high, and RLD carries every token, as PDD-FACTS predicts. The
``drift`` check below is what the PDD run must pass and the P-RLD-only run fails.

The fakes model the caches that matter: P remembers the block chains it prefilled (its
prefix cache: "P's hit rate" of a request is the prefix some P holds when it is sent), MD's
DRC is the fake KV plane's (blocks that landed). The WAN is P's reported 1 Mbit/s.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from pdd.cache.hashing import BlockHash
from tests.router.fake_kv import BLOCK_SIZE, FakeKvPlane, prompt_hashes
from tests.router.fake_worker import FakeWorker, Script
from tests.router.harness import RouterHarness

MODEL = "SmolLM2-135M-Instruct"
CONVERSATIONS, FOLLOW_UPS, CONCURRENCY, MAX_TOKENS = 12, 3, 4, 8
POLICY = {"ttft_budget_s": 0.1, "await_kv_poll_s": 0.05, "await_kv_timeout_s": 10.0,
          "kv_in_wait_s": 5.0, "catch_up_threshold_tokens": 4}  # fmt: skip
# The bounds normal traffic must keep (checked on the follow-up phase only).
MAX_HIT_GAP = 0.1  # MD's hit rate at most this far below P's
MAX_RLD_SHARE = 0.2  # RLD's share of the output tokens
MAX_RLD_IN_FLIGHT = 1  # requests on one RLD at once


class FleetFake(FakeWorker):
    """A fake that keeps P's prefix cache and counts peak requests and tokens out."""

    def __init__(self, worker_id: str, role: str, plane: FakeKvPlane):
        super().__init__(worker_id, 4096, role, plane)
        self.prefilled: set[BlockHash] = set()
        self.peak = 0
        self.tokens_out = 0

    def reset_counts(self) -> None:
        self.peak, self.tokens_out = 0, 0

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        if self.role == "prefill" and request.kv_stage:
            self.prefilled.update(prompt_hashes(list(request.prompt_token_ids)))
        async for resp in super().Generate(request, context):
            self.peak = max(self.peak, len(self.running))
            self.tokens_out += len(resp.token_ids)
            yield resp


def held(hashes: list[BlockHash], cache) -> int:  # type: ignore[no-untyped-def]
    n = 0
    while n < len(hashes) and hashes[n] in cache:
        n += 1
    return n


@dataclass
class Phase:
    p_hit: list[float] = field(default_factory=list)  # prefix some P holds, per request
    md_hit: list[float] = field(default_factory=list)  # prefix some MD's DRC holds
    records: list[dict] = field(default_factory=list)


@dataclass
class Outcome:
    cold: Phase
    normal: Phase
    rld_peak: int
    rld_share: float  # of the output tokens in the normal phase

    def rate(self, phase: Phase, key: str) -> float:
        values = getattr(phase, key)
        return sum(values) / len(values)


def drift(o: Outcome) -> list[str]:
    """The bounds a stable fleet keeps under normal traffic; each violation, in words."""
    out = []
    p_hit, md_hit = o.rate(o.normal, "p_hit"), o.rate(o.normal, "md_hit")
    if md_hit < p_hit - MAX_HIT_GAP:
        out.append(f"MD hit rate {md_hit:.2f} fell behind P's {p_hit:.2f}")
    if o.rld_share > MAX_RLD_SHARE:
        out.append(f"RLD emitted {o.rld_share:.0%} of the tokens")
    if o.rld_peak > MAX_RLD_IN_FLIGHT:
        out.append(f"an RLD ran {o.rld_peak} requests at once")
    return out


def start_fleet(codec, policy: str) -> tuple[RouterHarness, list[FleetFake]]:  # type: ignore[no-untyped-def]
    plane = FakeKvPlane()
    roles = [("p0", "prefill"), ("p1", "prefill"), ("rld0", "relay_decode"),
             ("rld1", "relay_decode"), ("md0", "main_decode"), ("md1", "main_decode")]  # fmt: skip
    fakes = [FleetFake(i, role, plane) for i, role in roles]
    for f in fakes:
        f.wan_bandwidth_bps = 1e6 if f.role == "prefill" else 0.0
        if f.kv is not None and f.role == "main_decode":
            f.kv.land_delay_s = 0.05
    h = RouterHarness(codec, fakes, plane, mode="pdd", max_queued_requests=32,
                      pdd={**POLICY, "test_policy": policy})  # fmt: skip
    h.start()
    return h, fakes


def script(fakes: list[FleetFake]) -> None:
    for f in fakes:  # every tier "is the model": the same tokens, one per 10 ms
        f.script = Script(tokens=[300, 301, 302, 303], repeat=True, step_delay_s=0.01)


def run_phase(h: RouterHarness, fakes: list[FleetFake], prompts: list[list[int]]) -> Phase:
    ps = [f for f in fakes if f.role == "prefill"]
    mds = [f for f in fakes if f.role == "main_decode"]
    phase = Phase()

    def one(prompt: list[int]) -> None:
        hashes = prompt_hashes(prompt)
        whole = len(hashes) * BLOCK_SIZE
        phase.p_hit.append(max(held(hashes, p.prefilled) for p in ps) * BLOCK_SIZE / whole)
        phase.md_hit.append(max(held(hashes, m.kv.drc) for m in mds) * BLOCK_SIZE / whole)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(h.url + "/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        phase.records.append(r.json()["pdd"])

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(one, prompts))
    return phase


def scenario(codec, policy: str) -> Outcome:  # type: ignore[no-untyped-def]
    """A cold burst opens 12 conversations; then 3 follow-up turns of each, round by round."""
    h, fakes = start_fleet(codec, policy)
    try:
        script(fakes)
        rng = random.Random(7)
        convs = [[rng.randrange(1000, 9000) for _ in range(240)] for _ in range(CONVERSATIONS)]
        cold = run_phase(h, fakes, [list(c) for c in convs])
        for f in fakes:
            f.reset_counts()
        normal = Phase()
        for _ in range(FOLLOW_UPS):
            for c in convs:  # the answer (scripted tokens) and a new user message
                c += [300, 301, 302, 303] * 2 + [rng.randrange(1000, 9000) for _ in range(16)]
            r = run_phase(h, fakes, [list(c) for c in convs])
            normal.p_hit += r.p_hit
            normal.md_hit += r.md_hit
            normal.records += r.records
        rlds = [f for f in fakes if f.role == "relay_decode"]
        total = sum(f.tokens_out for f in fakes if f.role != "prefill")
        rld_share = sum(f.tokens_out for f in rlds) / total
        assert all(not f.violations for f in fakes), [f.violations for f in fakes]
        return Outcome(cold, normal, max(f.peak for f in rlds), rld_share)
    finally:
        h.stop()


@pytest.fixture(scope="module")
def outcomes(codec) -> Iterator[dict[str, Outcome]]:  # type: ignore[no-untyped-def]
    yield {policy: scenario(codec, policy) for policy in ("pdd", "p_rld_only")}


def test_pdd_keeps_md_as_warm_as_p_and_rld_idle(outcomes):
    o = outcomes["pdd"]
    assert drift(o) == []
    assert {r["pipeline"] for r in o.cold.records} == {"p_rld_md"}  # cold: RLD hides the WAN
    assert {r["pipeline"] for r in o.normal.records} == {"p_md"}  # warm: straight to MD
    assert o.rate(o.normal, "md_hit") > 0.9 and o.rld_peak == 0 and o.rld_share == 0.0
    assert all(r["md"] in ("md0", "md1") and r["md_cached_tokens"] > 0 for r in o.normal.records)


def test_p_rld_only_drifts_md_cold_and_rld_loaded(outcomes):
    o = outcomes["p_rld_only"]
    problems = drift(o)
    assert len(problems) == 3, problems  # all three bounds break
    assert o.rate(o.normal, "p_hit") > 0.9 and o.rate(o.normal, "md_hit") == 0.0
    assert o.rld_share == 1.0
    assert all(r["md"] is None and r["rld"] in ("rld0", "rld1") for r in o.normal.records)
    assert sum(r["rld_tokens"] for r in o.normal.records) == MAX_TOKENS * len(o.normal.records)


def test_both_ps_and_both_mds_share_the_conversations(outcomes):
    firsts = outcomes["pdd"].cold.records
    for role, ids in (("p", {"p0", "p1"}), ("md", {"md0", "md1"})):
        counts = {i: sum(r[role] == i for r in firsts) for i in ids}
        assert min(counts.values()) >= CONVERSATIONS // 4, counts
