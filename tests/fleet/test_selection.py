"""Fleet selection on built snapshots (pure: no sockets): the documented MD and P scores,
RLD by free capacity, graceful degradation, the test-only p_rld_only switch, and the
router's LRU view of each P's prefix cache."""

from __future__ import annotations

import random

import pytest

from pdd.config import ModelConfig
from pdd.config.router import PddPolicyConfig
from pdd.protocol import HandoffMode, Pipeline, Role, RouterMode
from pdd.router.decide.policy import md_score, p_score, pick_md, pick_p
from pdd.router.decide.routing import choose
from pdd.router.decide.view import Decision, FleetView, RouteRequest, WorkerView
from pdd.router.fleet.routed_prefixes import RoutedPrefixes
from pdd.router.record import PddTrace

P, RLD, MD = Role.PREFILL, Role.RELAY_DECODE, Role.MAIN_DECODE
POLICY = PddPolicyConfig(ttft_budget_s=1.0, wan_rtt_s=0.0)  # md 0.5, p 0.25 (defaults)
GEOMETRY = {"block_size": 4, "kv_block_bytes": 1000}


def w(id_, role, **kw):
    return WorkerView(id_, role, True, **{**GEOMETRY, "max_num_seqs": 8, **kw})


def fleet(*workers, policy=POLICY):
    return FleetView(RouterMode.PDD, tuple(workers), policy)


def req(prompt=100, md=None, p=None):
    return RouteRequest(prompt, 16, md_cached_tokens=md or {}, p_cached_tokens=p or {})


TWO_P = (w("p0", P, wan_bandwidth_bps=1e9), w("p1", P, wan_bandwidth_bps=1e9))


def test_md_score_is_hit_fraction_minus_weighted_load_fraction():
    m = w("m0", MD, running=4)  # load fraction 4/8
    assert md_score(m, {"m0": 80}, 100, 0.5) == pytest.approx(0.8 - 0.25)
    assert p_score(w("p0", P, running=2), {"p0": 50}, 100, 0.25) == pytest.approx(0.5 - 0.5)


def _tie(v):
    return (v.load, v.kv_cache_usage, v.served, v.id)


@pytest.mark.parametrize("seed", range(20))
def test_p_and_md_picks_are_the_best_documented_score(seed):
    """pick_p / pick_md (their keys inline the scores for speed) choose what the documented
    scores choose: the highest score, full MDs last, ties by load, KV usage, served, id."""
    rng = random.Random(seed)
    prompt = rng.choice([1, 64, 100, 4096])
    cap = rng.choice([0, 4, 8])  # 0: capacity unknown
    ps = [w(f"p{i}", P, running=rng.randint(0, 5), waiting=rng.randint(0, 2),
            in_flight=rng.randint(0, 6), served=rng.randint(0, 3),
            kv_cache_usage=rng.choice([0.0, 0.5])) for i in range(rng.randint(1, 12))]  # fmt: skip
    mds = [w(f"m{i}", MD, running=rng.randint(0, 9), max_num_seqs=cap, served=rng.randint(0, 3),
             kv_cache_usage=rng.choice([0.0, 0.5])) for i in range(rng.randint(1, 6))]  # fmt: skip
    cached = {v.id: rng.choice([0, prompt // 2, prompt, 2 * prompt]) for v in ps + mds
              if rng.random() < 0.5}  # fmt: skip
    weight = rng.choice([0.0, 0.25, 0.5, 1.0])
    best_p = min(ps, key=lambda v: (-p_score(v, cached, prompt, weight), _tie(v)))
    assert pick_p(ps, cached, prompt, weight) is best_p
    best_md = min(mds, key=lambda v: (not v.has_capacity, -md_score(v, cached, prompt, weight),
                                      _tie(v)))  # fmt: skip
    assert pick_md(mds, cached, prompt, weight) is best_md


@pytest.mark.parametrize(
    ("m0_running", "chosen"),
    [(0, "m0"), (7, "m0"), (8, "m1")],  # 0.9-0.44=0.46 > 0; a full MD is skipped
)
def test_a_follow_up_stays_on_the_md_holding_its_history_until_it_is_full(m0_running, chosen):
    view = fleet(*TWO_P, w("m0", MD, running=m0_running), w("m1", MD))
    assert choose(view, req(100, md={"m0": 90})).worker(MD) == chosen


def test_a_small_hit_loses_to_a_much_less_loaded_md():
    view = fleet(*TWO_P, w("m0", MD, running=6), w("m1", MD))
    # m0: 0.2 - 0.5*6/8 = -0.175 < m1: 0.0
    assert choose(view, req(100, md={"m0": 20})).worker(MD) == "m1"


def test_every_md_full_still_routes_by_score():
    view = fleet(*TWO_P, w("m0", MD, running=8), w("m1", MD, running=9))
    assert choose(view, req(100, md={"m1": 100})).worker(MD) == "m1"


def test_cold_requests_take_turns_on_idle_workers():
    """Same load and cache everywhere: the fewest served wins, so idle workers alternate."""
    view = fleet(w("p0", P, served=3), w("p1", P, served=2), w("m0", MD, served=2),
                 w("m1", MD, served=3))  # fmt: skip
    d = choose(view, req(100))
    assert (d.worker(P), d.worker(MD)) == ("p1", "m0")


@pytest.mark.parametrize(
    ("p0_running", "chosen"),
    [(0, "p0"), (3, "p0"), (4, "p1")],  # 0.8 - 0.25*3 = 0.05 > 0; at 4 queued: -0.2 < 0
)
def test_p_holding_the_prefix_wins_unless_its_queue_is_much_longer(p0_running, chosen):
    view = fleet(w("p0", P, running=p0_running), w("p1", P), w("m0", MD))
    assert choose(view, req(100, p={"p0": 80})).worker(P) == chosen


def test_rld_by_most_free_slots_and_degrade_to_p_md_when_none_has_one():
    slow_p = w("p0", P, wan_bandwidth_bps=8000.0)  # a miss takes 25 s over this WAN
    relays = [w("r0", RLD, running=2, max_num_seqs=4), w("r1", RLD, running=3, max_num_seqs=8)]
    d = choose(fleet(slow_p, *relays, w("m0", MD)), req(100))
    assert (d.pipeline, d.worker(RLD)) == (Pipeline.P_RLD_MD, "r1")  # 5 free > 2 free
    assert d.handoff is HandoffMode.CATCH_UP  # r1 at 3/8 < 0.5
    full = [w("r0", RLD, running=4, max_num_seqs=4), w("r1", RLD, running=8)]
    d = choose(fleet(slow_p, *full, w("m0", MD)), req(100))
    assert (d.pipeline, d.maybe_worker(RLD), d.handoff) == (Pipeline.P_MD, None, HandoffMode.NONE)


def test_p_rld_only_test_policy_never_touches_md():
    policy = PddPolicyConfig(test_policy="p_rld_only")
    view = fleet(w("p0", P), w("r0", RLD, running=1), w("r1", RLD), w("m0", MD), policy=policy)
    d = choose(view, req(100, md={"m0": 100}))
    assert d == Decision(Pipeline.PD, ((P, "p0"), (RLD, "r1")), block_size=4, relay_only=True)
    trace = PddTrace.for_decision(d, 100)
    trace.count("d", 5)  # the pd driver's decoder tier
    s = trace.summary()
    assert (s.p, s.rld, s.md, s.rld_tokens, s.md_cached_tokens) == ("p0", "r1", None, 5, 0)


def test_records_name_the_instances():
    d = Decision(Pipeline.P_RLD_MD, ((P, "p1"), (RLD, "r0"), (MD, "m1")), HandoffMode.ONE_SHOT)
    s = PddTrace.for_decision(d, 10).summary()
    assert (s.p, s.rld, s.md) == ("p1", "r0", "m1")


def test_prefill_prefix_view_is_a_bounded_lru_of_chains():
    view = RoutedPrefixes(ModelConfig(), capacity=6)
    a, b = list(range(100, 116)), list(range(200, 216))  # 4 blocks of 4 each
    view.record("p0", a, 4)
    assert view.cached_tokens(a + [1, 2, 3, 4], {"p0": 4, "p1": 4}) == {"p0": 16, "p1": 0}
    assert view.cached_tokens(a[:8] + [9] * 8, {"p0": 4}) == {"p0": 8}  # shared prefix only
    view.record("p0", b, 4)  # 8 hashes > 6: a's two deepest blocks go first (leaves)
    assert view.size("p0") == 6
    assert view.cached_tokens(a, {"p0": 4}) == {"p0": 8}
    assert view.cached_tokens(b, {"p0": 4}) == {"p0": 16}
    assert view.cached_tokens(a, {"p0": 8}) == {"p0": 0}  # another block size: other names
    view.forget("p0")
    assert view.cached_tokens(b, {"p0": 4}) == {"p0": 0}
    off = RoutedPrefixes(ModelConfig(), capacity=0)
    off.record("p0", a, 4)
    assert off.cached_tokens(a, {"p0": 4}) == {"p0": 0}


def test_fleet_yaml_is_two_of_each_role_small_and_bound_like_local():
    from pdd.config import load_config
    from tests.helpers import REPO

    cfg = load_config(f"{REPO}/configs/fleet.yaml")
    assert cfg.router.mode is RouterMode.PDD
    assert [(w.id, w.role) for w in cfg.workers] == [
        ("p0", P), ("p1", P), ("rld0", RLD), ("rld1", RLD), ("md0", MD), ("md1", MD)]  # fmt: skip
    engines = [cfg.engine_for(w.id) for w in cfg.workers]
    assert {(e.kv_cache_space_gib, e.max_model_len, e.block_size) for e in engines} == {
        (0.25, 2048, 32)}  # fmt: skip
    assert [e.omp_threads_bind for e in engines] == ["0", "0", "1", "1", "1", "1"]
    idle = fleet(*(w(x.id, x.role) for x in cfg.workers), policy=cfg.router.pdd)
    first = choose(idle, req(100))
    chosen = {first.worker(P), first.worker(MD)}
    served = fleet(*(w(x.id, x.role, served=int(x.id in chosen)) for x in cfg.workers),
                   policy=cfg.router.pdd)  # fmt: skip
    second = choose(served, req(100))
    assert {first.worker(P), second.worker(P)} == {"p0", "p1"}  # idle instances alternate
    assert {first.worker(MD), second.worker(MD)} == {"md0", "md1"}
