"""PDD and baseline routing policy on built snapshots (no sockets)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdd.config.router import PddPolicyConfig
from pdd.errors import InvalidRequestError, UnavailableError
from pdd.protocol import HandoffMode, Pipeline, Role, RouterMode
from pdd.router.decide.policy import md_computes_rest_sooner
from pdd.router.decide.routing import Decision, FleetView, RouteRequest, WorkerView, choose

P, RLD, MD = Role.PREFILL, Role.RELAY_DECODE, Role.MAIN_DECODE
# 4-token blocks of 1000 bytes; P measured 8000 bit/s: 1 s per missing block; no RTT.
POLICY = PddPolicyConfig(ttft_budget_s=1.0, wan_rtt_s=0.0, catch_up_load_threshold=0.5)
GEOMETRY = {"block_size": 4, "kv_block_bytes": 1000}


def p(id_="p0", **kw):
    fields = {"datacenter": "dc-a", "wan_bandwidth_bps": 8000.0, **GEOMETRY, **kw}
    return WorkerView(id_, P, True, **fields)


def rld(id_="rld0", **kw):
    return WorkerView(id_, RLD, True, **{"datacenter": "dc-a", "max_num_seqs": 4, **kw})


def md(id_="md0", **kw):
    return WorkerView(id_, MD, True, **{"datacenter": "dc-b", "max_num_seqs": 8, **kw})


def fleet(*workers, mode=RouterMode.PDD, policy=POLICY):
    return FleetView(mode, tuple(workers), policy)


def req(prompt=40, cached=None, **kw):
    return RouteRequest(prompt, 16, md_cached_tokens=cached or {}, **kw)


def test_full_hit_goes_p_md_with_no_wan_bytes():
    d = choose(fleet(p(), rld(), md()), req(40, {"md0": 40}))
    assert d == Decision(Pipeline.P_MD, ((P, "p0"), (MD, "md0")), HandoffMode.NONE, 40, 0, 0.0, 4)


def test_miss_goes_p_rld_md_catch_up_on_an_idle_rld():
    d = choose(fleet(p(), rld(), md()), req(40, {"md0": 0}))
    assert d == Decision(
        Pipeline.P_RLD_MD, ((P, "p0"), (RLD, "rld0"), (MD, "md0")), HandoffMode.CATCH_UP,
        0, 10_000, 10.0, 4,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("missing_blocks", "pipeline"),
    [(0, Pipeline.P_MD), (1, Pipeline.P_MD), (2, Pipeline.P_RLD_MD)],  # eta 0, 1.0 = budget, 2
)
def test_eta_against_the_ttft_budget(missing_blocks, pipeline):
    d = choose(fleet(p(), rld(), md()), req(40, {"md0": 40 - 4 * missing_blocks}))
    assert (d.pipeline, d.wan_bytes, d.eta_s) == (pipeline, missing_blocks * 1000, missing_blocks)


def test_eta_counts_the_bytes_that_cross_after_p_s_codec():
    # 2 missing blocks raw = 2 s > the 1 s budget; P's int8 codec halves them: p_md.
    d = choose(fleet(p(wan_wire_ratio=0.5), rld(), md()), req(40, {"md0": 32}))
    assert (d.pipeline, d.wan_bytes, d.eta_s) == (Pipeline.P_MD, 1000, 1.0)
    for unknown in (0.0, 1.7):  # not reported, or nonsense: raw
        d = choose(fleet(p(wan_wire_ratio=unknown), rld(), md()), req(40, {"md0": 32}))
        assert (d.pipeline, d.wan_bytes) == (Pipeline.P_RLD_MD, 2000)


def test_rtt_counts_and_config_fills_in_unmeasured_link():
    policy = PddPolicyConfig(ttft_budget_s=1.0, wan_rtt_s=0.5, wan_bandwidth_bps=16000.0)
    unmeasured = p(wan_bandwidth_bps=0.0)
    d = choose(fleet(unmeasured, rld(), md(), policy=policy), req(40, {"md0": 36}))
    assert (d.pipeline, d.eta_s) == (Pipeline.P_MD, 1.0)  # 0.5 + 8000 bits / 16000
    measured = p(wan_bandwidth_bps=8000.0, wan_rtt_s=0.25)
    d = choose(fleet(measured, rld(), md(), policy=policy), req(40, {"md0": 36}))
    assert (d.pipeline, d.eta_s) == (Pipeline.P_RLD_MD, 1.25)


def test_the_eta_uses_p_s_link_to_the_md_it_names_and_what_is_queued_on_it():
    """P reports each link (its warm-up measures them before the first request): the ETA to
    an MD is that link's, not P's best one; bytes already queued on it count up to the new
    transfer's own size (the sender serves the fewest bytes left first)."""
    from pdd.router.decide.view import WanLinkView

    links = (("md0", WanLinkView(4000.0, 0.0)), ("md1", WanLinkView(16000.0, 0.0, 500)))
    p0 = p(wan_bandwidth_bps=16000.0, wan_links=links)  # best link: 16 kbit/s
    one_block = req(40, {"md0": 36, "md1": 36})
    d = choose(fleet(p0, rld(), md("md0")), one_block)
    assert (d.pipeline, d.eta_s) == (Pipeline.P_RLD_MD, 2.0)  # 8000 bits at 4 kbit/s
    d = choose(fleet(p0, rld(), md("md1")), one_block)
    assert (d.pipeline, d.eta_s) == (Pipeline.P_MD, 0.75)  # (500 queued + 1000) B at 16 kbit/s
    busy = p(wan_links=(("md0", WanLinkView(8000.0, 0.0, 10**6)),))
    d = choose(fleet(busy, rld(), md("md0")), one_block)
    assert d.eta_s == 2.0  # 1 MB queued: only the new transfer's own 1000 B of it go first
    unmeasured = p(wan_links=(("md0", WanLinkView(0.0, 0.0)),))  # P's best figure stands in
    assert choose(fleet(unmeasured, rld(), md("md0")), one_block).eta_s == 1.0


@pytest.mark.parametrize(
    ("rate", "pipeline", "wan_bytes", "eta"),
    [
        (80.0, Pipeline.P_MD, 0, 0.25 + 40 / 80),  # 0.75 s: MD computes, nothing crosses
        (40.0, Pipeline.P_RLD_MD, 10_000, 10.0),  # 1.25 s: sooner than the WAN, over budget
        (3.5, Pipeline.P_RLD_MD, 10_000, 10.0),  # 11.7 s: slower than the WAN
        (0.0, Pipeline.P_RLD_MD, 10_000, 10.0),  # MD measured nothing: never recompute
    ],
)
def test_recompute_or_wait_takes_the_sooner_of_md_s_prefill_and_the_wan(rate, pipeline,
                                                                        wan_bytes, eta):  # fmt: skip
    """A 40-token miss: 10 blocks, 10 s over the WAN; MD's measured prefill takes 0.25 s + 40
    tokens at ``rate``. The sooner of the two is weighed against the 1 s budget: MD computes
    only on p_md (on p_rld_md the WAN carries MD's KV while RLD streams)."""
    mdw = md(prefill_tokens_per_s=rate, prefill_fixed_s=0.25)
    d = choose(fleet(p(), rld(), mdw), req(40, {"md0": 0}))
    assert (d.pipeline, d.md_computes, d.wan_bytes) == (pipeline, not wan_bytes, wan_bytes)
    assert d.eta_s == pytest.approx(eta)


def test_recompute_is_bounded_by_its_switch_and_max_tokens_and_needs_a_missing_block():
    """On by default for a miss of at most md_recompute_max_tokens (a warm turn's tail). A
    longer miss (a cold prompt): its KV crosses, RLD streaming while it does; on p_md (no RLD
    covers the wait) the bound gives way only when waiting would miss the TTFT budget.
    md_recompute off: MD always waits for its KV."""
    fast = md(prefill_tokens_per_s=1e6)
    miss, p_md = req(40, {"md0": 0}), req(40, {"md0": 0}, pipeline=Pipeline.P_MD)
    assert choose(fleet(p(), rld(), fast), miss).md_computes  # POLICY's default
    off = fleet(p(), rld(), fast, policy=POLICY.model_copy(update={"md_recompute": False}))
    capped = POLICY.model_copy(update={"md_recompute_max_tokens": 39})
    for view in (off, fleet(p(), rld(), fast, policy=capped)):
        d = choose(view, miss)  # 10 s of WAN, over the 1 s budget: RLD covers it
        assert (d.pipeline, d.md_computes, d.wan_bytes) == (Pipeline.P_RLD_MD, False, 10_000)
    assert not choose(off, p_md).md_computes
    assert not md_computes_rest_sooner(off.workers[0], fast, 0, 0, 0, 40, off)
    # p_md over the bound: a 10 s wait misses the 1 s budget, so MD computes; within a 20 s
    # budget it waits for its KV (at the first choice and when asked again)
    for budget, computes in ((1.0, True), (20.0, False)):
        view = fleet(p(), rld(), fast, policy=capped.model_copy(update={"ttft_budget_s": budget}))
        d = choose(view, p_md)
        assert (d.pipeline, d.md_computes, d.wan_bytes) == (
            Pipeline.P_MD, computes, 0 if computes else 10_000)  # fmt: skip
        assert md_computes_rest_sooner(view.workers[0], fast, 0, 0, 0, 40, view) is computes
    d = choose(fleet(p(), rld(), fast), req(40, {"md0": 40}))  # a full hit
    assert (d.pipeline, d.md_computes, d.wan_bytes, d.eta_s) == (Pipeline.P_MD, False, 0, 0.0)
    # a forced p_md computes when that is sooner; a forced p_rld_md always sends MD its KV
    forced = choose(fleet(p(), rld(), fast), req(40, {"md0": 0}, pipeline=Pipeline.P_MD))
    assert (forced.pipeline, forced.md_computes, forced.wan_bytes) == (Pipeline.P_MD, True, 0)
    forced = choose(fleet(p(), rld(), fast), req(40, {"md0": 0}, pipeline=Pipeline.P_RLD_MD))
    assert (forced.pipeline, forced.md_computes, forced.wan_bytes) == (
        Pipeline.P_RLD_MD, False, 10_000)  # fmt: skip


def test_waiting_md_computes_the_rest_only_for_bytes_still_to_cross():
    """Asked again while MD waits: a 40-token miss (10 blocks, 10 s over the WAN) against
    MD's prefill of 0.25 s + tokens / 40. What landed or reached MD never crosses again."""
    pw, mdw = p(), md(prefill_tokens_per_s=40.0, prefill_fixed_s=0.25, **GEOMETRY)
    view = fleet(pw, rld(), mdw)
    assert md_computes_rest_sooner(pw, mdw, 0, 0, 0, 40, view)  # 1.25 s against 10 s
    assert md_computes_rest_sooner(pw, mdw, 0, 8, 0, 40, view)  # 0.45 s against 2 s
    assert not md_computes_rest_sooner(pw, mdw, 0, 0, 9_500, 40, view)  # 1.25 s against 0.5 s
    # the transfer ended, its blocks not yet committed: nothing is left to cross
    assert not md_computes_rest_sooner(pw, mdw, 0, 0, 10_000, 40, view)
    assert not md_computes_rest_sooner(pw, mdw, 40, 10, 0, 40, view)  # all cached
    # more than md_recompute_max_tokens still missing: MD waits while the rest arrives within
    # the budget (here 20 s); 8 landed blocks leave 8 tokens, under the bound
    bound = {"md_recompute_max_tokens": 8, "ttft_budget_s": 20.0}
    capped = fleet(pw, rld(), mdw, policy=POLICY.model_copy(update=bound))
    assert not md_computes_rest_sooner(pw, mdw, 0, 0, 0, 40, capped)
    assert md_computes_rest_sooner(pw, mdw, 0, 8, 0, 40, capped)


def test_routes_only_where_the_prompt_s_kv_fits():
    """Each worker's Stats say how many KV blocks a new request can have. A 40-token prompt
    (10 blocks) goes to the P and the MD with room for it; an RLD without room is not picked
    (p_md instead); when no P has room the best P is chosen anyway (its refusal answers)."""
    room = {"kv_arena_blocks": 16, "kv_free_blocks": 10}
    tight = {"kv_arena_blocks": 16, "kv_free_blocks": 9}
    d = choose(fleet(p("p0", **tight), p("p1", **room), rld(**GEOMETRY, **room),
                     md("md0", **GEOMETRY, **tight), md("md1", **GEOMETRY, **room)), req(40))  # fmt: skip
    assert dict(d.assignments) == {P: "p1", RLD: "rld0", MD: "md1"}
    # md0 holds 8 of the tokens: it lacks 8 blocks, which fit
    d = choose(fleet(p(), rld(), md("md0", **GEOMETRY, **tight), md("md1", **GEOMETRY, **room)),
               req(40, {"md0": 8}))  # fmt: skip
    assert d.worker(MD) == "md0"
    d = choose(fleet(p(), rld(**GEOMETRY, **tight), md()), req(40))
    assert (d.pipeline, d.maybe_worker(RLD)) == (Pipeline.P_MD, None)
    d = choose(fleet(p("p0", **tight), p("p1", kv_arena_blocks=16, kv_free_blocks=0), rld(),
                     md()), req(40))  # fmt: skip
    assert d.worker(P) == "p0"


def test_partial_tail_block_is_never_sent_and_cache_is_clipped_to_the_prompt():
    d = choose(fleet(p(), rld(), md()), req(10, {"md0": 8}))  # 2 whole blocks, both cached
    assert (d.pipeline, d.wan_bytes, d.md_cached_tokens) == (Pipeline.P_MD, 0, 8)
    d = choose(fleet(p(), rld(), md()), req(10, {"md0": 400}))
    assert (d.md_cached_tokens, d.wan_bytes) == (10, 0)


@pytest.mark.parametrize(
    ("running", "handoff"),
    [(0, HandoffMode.CATCH_UP), (1, HandoffMode.CATCH_UP), (2, HandoffMode.ONE_SHOT)],
)
def test_handoff_mode_follows_rld_load(running, handoff):
    # A busy RLD (2/4 = 0.5, at the threshold) is freed soonest with One-Shot.
    d = choose(fleet(p(), rld(running=running), md()), req(40))
    assert (d.pipeline, d.handoff) == (Pipeline.P_RLD_MD, handoff)


@pytest.mark.parametrize(
    "relays",
    [
        (),
        (rld(running=4),),  # full: 4 of max_num_seqs 4
        (rld(in_flight=4),),  # this router's own count says full
        (WorkerView("rld0", RLD, False, max_num_seqs=4),),  # unhealthy
    ],
)
def test_no_rld_capacity_means_p_md_even_for_a_miss(relays):
    d = choose(fleet(p(), *relays, md()), req(40))
    assert (d.pipeline, d.handoff, d.maybe_worker(RLD)) == (Pipeline.P_MD, HandoffMode.NONE, None)


def test_least_loaded_p_and_rld_with_capacity():
    view = fleet(
        p("p0", running=3), p("p1", running=1), p("p2", running=1, kv_cache_usage=0.5),
        rld("r0", running=4), rld("r1", running=2), rld("r2", running=1), md(),
    )  # fmt: skip
    d = choose(view, req(40))
    assert (d.worker(P), d.worker(RLD)) == ("p1", "r2")


def test_md_by_longest_prefix_then_load_then_id():
    view = fleet(p(), md("m0", running=5), md("m1", running=1), md("m2", running=1))
    assert choose(view, req(40, {"m0": 32, "m1": 8})).worker(MD) == "m0"
    assert choose(view, req(40, {"m0": 8, "m1": 8, "m2": 8})).worker(MD) == "m1"
    assert choose(view, req(40)).worker(MD) == "m1"


def test_unknown_block_geometry_is_an_infinite_eta():
    view = fleet(p(block_size=0), rld(), md())
    d = choose(view, req(40, {"md0": 40}))
    assert (d.pipeline, d.eta_s) == (Pipeline.P_RLD_MD, math.inf)
    assert choose(fleet(p(kv_block_bytes=0), md()), req(40)).pipeline is Pipeline.P_MD


def test_md_geometry_fills_in_for_p():
    view = fleet(p(block_size=0, kv_block_bytes=0), rld(), md(**GEOMETRY))
    d = choose(view, req(40, {"md0": 40}))
    assert (d.pipeline, d.wan_bytes, d.block_size) == (Pipeline.P_MD, 0, 4)


def test_forced_pipeline_and_handoff():
    view = fleet(p(), rld(running=4), md())
    d = choose(view, req(40, {"md0": 40}, pipeline=Pipeline.P_RLD_MD))
    assert (d.pipeline, d.worker(RLD), d.handoff) == (
        Pipeline.P_RLD_MD,
        "rld0",
        HandoffMode.ONE_SHOT,  # a full RLD is freed soonest
    )
    d = choose(view, req(40, pipeline=Pipeline.P_RLD_MD, handoff=HandoffMode.CATCH_UP))
    assert d.handoff is HandoffMode.CATCH_UP
    d = choose(fleet(p(), rld(), md()), req(40, pipeline=Pipeline.P_MD))
    assert (d.pipeline, d.maybe_worker(RLD), d.wan_bytes) == (Pipeline.P_MD, None, 10_000)
    d = choose(fleet(p(), rld(), md()), req(40, handoff=HandoffMode.ONE_SHOT))
    assert d.handoff is HandoffMode.ONE_SHOT


def test_forced_p_rld_md_without_a_healthy_rld_is_unavailable():
    with pytest.raises(UnavailableError) as info:
        choose(fleet(p(), md()), req(40, pipeline=Pipeline.P_RLD_MD))
    assert info.value.message == "no relay_decode worker is configured"


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ((md(),), "no prefill worker is configured"),
        ((WorkerView("p0", P, False), md()), "no healthy prefill worker (0 of 1 healthy); retry later"),
        ((p(), rld()), "no main_decode worker is configured"),
    ],
)  # fmt: skip
def test_pdd_without_p_or_md_is_unavailable(workers, message):
    with pytest.raises(UnavailableError) as info:
        choose(fleet(*workers), req(40))
    assert info.value.message == message


def test_pd_wan_sends_a_remote_md_the_blocks_its_drc_lacks():
    local = md("dl0", datacenter="dc-a")
    view = fleet(p(), rld(), local, md("md0", running=3), mode=RouterMode.PD_WAN)
    d = choose(view, req(41, {"md0": 20}))  # 5 of the prompt's 10 whole blocks
    assert d == Decision(Pipeline.PD, ((P, "p0"), (MD, "md0")), HandoffMode.NONE, 20, 5_000, 5.0, 4)
    cold = choose(view, req(41))
    assert (cold.md_cached_tokens, cold.wan_bytes, cold.eta_s) == (0, 10_000, 10.0)
    assert d.decoder == "md0"
    assert choose(fleet(p(), local, mode=RouterMode.PD_WAN), req(40)).decoder == "dl0"


def test_pd_local_prefers_a_main_decode_in_p_datacenter_then_its_relay():
    view = fleet(
        p(), rld(), md("dl0", datacenter="dc-a", running=5), md(), mode=RouterMode.PD_LOCAL
    )
    assert choose(view, req(40)).assignments == ((P, "p0"), (MD, "dl0"))
    d = choose(fleet(p(), rld(), md(), mode=RouterMode.PD_LOCAL), req(40, {"rld0": 40}))
    assert (d.assignments, d.decoder) == (((P, "p0"), (RLD, "rld0")), "rld0")
    assert d.md_cached_tokens == 0  # an RLD keeps no prefix across requests: every block
    with pytest.raises(UnavailableError) as info:
        choose(fleet(p(), md(), mode=RouterMode.PD_LOCAL), req(40))
    assert "no healthy main_decode or relay_decode worker in P's datacenter 'dc-a'" in str(
        info.value
    )


@pytest.mark.parametrize("mode", [RouterMode.COLOCATED, RouterMode.PD_WAN, RouterMode.PD_LOCAL])
def test_overrides_need_mode_pdd(mode):
    view = fleet(WorkerView("w0", Role.COLOCATED, True), p(), md(), mode=mode)
    with pytest.raises(InvalidRequestError) as info:
        choose(view, req(40, pipeline=Pipeline.P_MD))
    assert info.value.param == "pdd" and info.value.status_code == 400


def test_load_fraction_and_capacity_with_unknown_max_num_seqs():
    w = WorkerView("r", RLD, True, running=50)
    assert (w.load_fraction, w.has_capacity) == (0.0, True)
    assert rld(running=1, waiting=1).load_fraction == 0.5


@given(
    n_rld=st.integers(0, 3),
    rld_load=st.lists(st.integers(0, 6), min_size=3, max_size=3),
    cached=st.integers(0, 80),
    prompt=st.integers(1, 80),
    bandwidth=st.sampled_from([0.0, 800.0, 8000.0, 1e9]),
    forced=st.sampled_from([None, Pipeline.P_MD]),
)
def test_never_a_p_rld_pipeline(n_rld, rld_load, cached, prompt, bandwidth, forced):
    relays = [rld(f"r{i}", running=rld_load[i]) for i in range(n_rld)]
    d = choose(fleet(p(wan_bandwidth_bps=bandwidth), *relays, md()),
               req(prompt, {"md0": cached}, pipeline=forced))  # fmt: skip
    roles = [r for r, _ in d.assignments]
    assert roles[0] is P and roles[-1] is MD  # every request starts on P and ends on MD
    assert (RLD in roles) == (d.pipeline is Pipeline.P_RLD_MD)
    assert (d.handoff is HandoffMode.NONE) == (d.pipeline is Pipeline.P_MD)
    if RLD in roles:
        assert forced is None and d.eta_s > POLICY.ttft_budget_s
        chosen = next(w for w in relays if w.id == d.worker(RLD))
        assert chosen.has_capacity


def test_policy_config_loads_from_overrides_and_checks_poll_vs_timeout():
    from pdd.config import load_config
    from pdd.errors import ConfigError

    cfg = load_config(None, ["router.mode=pdd", "router.pdd.ttft_budget_s=0.25"])
    assert (cfg.router.pdd.ttft_budget_s, cfg.router.pdd.catch_up_threshold_tokens) == (0.25, 64)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["router.pdd.await_kv_poll_s=5", "router.pdd.await_kv_timeout_s=1"])
    assert "await_kv_poll_s must not exceed await_kv_timeout_s" in info.value.message
    with pytest.raises(ConfigError) as info:
        load_config(None, ["router.pdd.ttft_budget=1"])
    assert "router.pdd.ttft_budget: unknown key" in info.value.message
