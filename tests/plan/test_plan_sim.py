"""The simulator runs pdd's own routing: a policy change in the router changes its choices."""

from __future__ import annotations

import pytest

from pdd.config.router import PddPolicyConfig
from pdd.plan.fleet import Fleet, Group
from pdd.plan.sim import SimSettings, Simulation, Wan
from pdd.plan.stats import Sla
from pdd.plan.workload import AgenticWorkload, Conversation, Turn, Workload, agentic
from pdd.protocol import HandoffMode, Pipeline, Role, RouterMode
from pdd.router.decide import policy as router_policy
from pdd.router.decide import routing

WAN = Wan(10e9, 0.04, 0.01)
SLA = Sla(5.0, 0.05)


def _pdd(p: int = 2, rld: int = 1, md: int = 2) -> Fleet:
    return Fleet(RouterMode.PDD, (Group(Role.PREFILL, "A", p), Group(Role.RELAY_DECODE, "A", rld),
                                  Group(Role.MAIN_DECODE, "B", md)))  # fmt: skip


def _work(**kw) -> object:
    base = {"requests": 120, "rate": 1.0, "context_tokens": 16384, "output_tokens": 128}
    return agentic(AgenticWorkload(**{**base, **kw}))


def _run(fleet: Fleet, profiles, workload, **settings):
    return Simulation(fleet, profiles, WAN, workload, SLA, SimSettings(**settings)).run()


def test_a_short_plan_run_reports_every_figure(profiles) -> None:
    res = _run(_pdd(), profiles, _work())
    assert res.requests == 120 and res.measured > 50  # the steady-state window
    assert res.meets_sla and res.goodput_rps > 0 and res.bcr > 0
    assert res.cost_per_hour > res.hardware_cost_per_hour  # the WAN's GB are priced
    assert res.pipelines.get("p_md", 0) + res.pipelines.get("p_rld_md", 0) == 120
    assert 0 < res.wan_utilisation < 1 and res.wan_gb > 0
    assert res.ttft_p50_s > 0 and res.tpot_p50_s > 0


def test_the_ttft_budget_of_router_pdd_moves_requests_between_pipelines(profiles) -> None:
    work = _work(hit_rate=0.5)
    lax = _run(_pdd(), profiles, work, policy=PddPolicyConfig(ttft_budget_s=100.0))
    tight = _run(_pdd(rld=4), profiles, work, policy=PddPolicyConfig(ttft_budget_s=0.001))
    assert lax.pipelines == {"p_md": 120} and lax.rld_token_share == 0
    assert tight.pipelines.get("p_rld_md", 0) > 100 and tight.rld_token_share > 0


def test_the_simulator_calls_the_routers_choose(profiles, monkeypatch) -> None:
    """Patch the router's policy function: the simulated choice follows it."""
    calls = []
    real = router_policy.choose_pdd

    def forced(view, request):
        calls.append(request.prompt_tokens)
        return real(view, request.__class__(**{**_fields(request), "pipeline": Pipeline.P_RLD_MD,
                                               "handoff": HandoffMode.ONE_SHOT}))  # fmt: skip

    monkeypatch.setattr(routing, "choose_pdd", forced)
    res = _run(_pdd(), profiles, _work(requests=40))
    assert len(calls) == 40
    assert res.pipelines == {"p_rld_md": 40}
    assert set(res.handoffs) <= {"one_shot", "rld_finished"}


def _fields(request) -> dict:
    return {f: getattr(request, f) for f in request.__dataclass_fields__}


def test_rld_finishing_first_leaves_md_s_transfer_to_p_s_send_deadline(profiles) -> None:
    """Short answers of one-turn conversations on a slow link: RLD ends before the KV lands,
    and each transfer goes on behind the others, cut at P's send deadline (120 s): the link
    carries more than the crossed part alone, never more than it can in the run."""
    slow = Wan(0.2e9, 0.04)
    work = _work(requests=30, hit_rate=0.0, output_tokens=8, context_tokens=32768)
    res = Simulation(_pdd(rld=2), profiles, slow, work, SLA,
                     SimSettings(policy=PddPolicyConfig(ttft_budget_s=0.01))).run()  # fmt: skip
    assert res.handoffs.get("rld_finished", 0) > 20
    full = 30 * (32768 // 128 * 128) * 57344 / 1e9
    assert res.wan_gb < full  # cut at the deadline: not every prompt's KV crossed
    assert res.wan_utilisation > 0.9  # the link stayed busy with what was still worth having


def _two_turns(think_s: float) -> Workload:
    """One agent conversation: a cold 8,192-token prompt with an 8-token answer, then the
    history plus 64 new tokens after ``think_s``."""
    turns = (Turn(8192, 8), Turn(8192 + 8 + 64, 8, think_s=think_s))
    return Workload("two-turns", (Conversation(0, 0.0, turns),))


@pytest.mark.parametrize("think_s", [30.0, 0.5])
def test_md_learns_the_prefix_of_a_turn_rld_finished(profiles, think_s: float) -> None:
    """At 1 Gbit/s the cold prompt's KV takes ~3.8 s, RLD's 8 tokens much less: the first
    turn ends on RLD. Its KV still reaches MD: after 30 s of thinking the next turn finds
    the prefix on MD and goes p_md; after 0.5 s it cuts the first transfer and carries the
    rest itself. Either way the prompt's KV crosses once, not twice."""
    wan = Wan(1e9, 0.04)
    res = Simulation(_pdd(p=1, rld=1, md=1), profiles, wan, _two_turns(think_s), SLA,
                     SimSettings(warmup_fraction=0.0)).run()  # fmt: skip
    assert res.handoffs.get("rld_finished", 0) >= 1
    once = (8192 + 8 + 64) // 128 * 128 * 57344 / 1e9
    assert res.wan_gb <= 1.05 * once, (res.wan_gb, once)
    if think_s > 10:
        assert res.pipelines == {"p_rld_md": 1, "p_md": 1}


@pytest.mark.parametrize("mode", [RouterMode.PD_LOCAL, RouterMode.PD_WAN, RouterMode.COLOCATED])
def test_baselines_run(profiles, mode: RouterMode) -> None:
    groups = ((Group(Role.COLOCATED, "A", 3),) if mode is RouterMode.COLOCATED
              else (Group(Role.PREFILL, "A", 2), Group(Role.MAIN_DECODE, "A", 2)))  # fmt: skip
    res = _run(Fleet(mode, groups), profiles, _work(requests=60))
    assert res.measured > 20 and res.ttft_p50_s > 0
    assert (res.wan_gb > 0) == (mode is RouterMode.PD_WAN)
    assert res.rld_token_share == 0


def test_exact_radix_cache_gives_the_same_run(profiles) -> None:
    work = _work(requests=60)
    fast = _run(_pdd(), profiles, work)
    exact = _run(_pdd(), profiles, work, exact_cache=True)
    assert exact.wan_gb == pytest.approx(fast.wan_gb)
    assert exact.ttft_p50_s == pytest.approx(fast.ttft_p50_s)


def test_long_answers_shape_a_workload_with_fewer_turns_instead_of_crashing():
    """A 95% hit with 1,024-token answers in a 16K context: the usual 40 turns would leave no
    first prompt; the shape takes the most turns that leave one and still meets the hit."""
    wl = AgenticWorkload(requests=300, rate=6.0, context_tokens=16384, output_tokens=1024,
                         hit_rate=0.95, seed=3)  # fmt: skip
    conversations = agentic(wl).conversations
    assert all(len(c.turns) == 32 for c in conversations[:-1])


def test_the_wan_link_shares_its_rate_so_a_small_transfer_never_waits_behind_a_big_one():
    """Like pdd's TCP sender (the transfer with the fewest bytes left first): a 2-block
    transfer sent while a 1 GB one runs takes the link at once and lands its own bytes' time
    plus half an RTT later; the big one still lands (later by the small one's bytes), and
    every byte is counted once."""
    import simpy

    from pdd.plan.servers import Link

    env = simpy.Environment()
    link = Link(env, bandwidth_bps=8e9, rtt_s=0.04)  # 1 GB/s
    big = link.send(1_000_000_000)
    landed: dict[str, float] = {}

    def small_later():
        yield env.timeout(0.2)
        small = link.send(2_000_000)  # 2 ms alone on the link
        yield small.landed
        landed["small"] = env.now

    def wait_big():
        yield big.landed
        landed["big"] = env.now

    env.process(small_later())
    env.process(wait_big())
    env.run()
    assert landed["small"] - 0.2 == pytest.approx(0.002 + 0.02)
    assert landed["big"] == pytest.approx(1.0 + 0.002 + 0.02)
    assert link.bytes_sent == pytest.approx(1_002_000_000)
    assert link.utilisation(1.002) == pytest.approx(1.0)


def test_a_cancelled_transfer_gives_the_link_to_the_rest():
    import simpy

    from pdd.plan.servers import Link

    env = simpy.Environment()
    link = Link(env, bandwidth_bps=8e9, rtt_s=0.0)
    a, b = link.send(1_000_000_000), link.send(1_000_000_000)
    done: list[float] = []

    def cut_a():
        yield env.timeout(0.5)  # a (the first of equals) has 500 MB across, b nothing
        link.cancel(a)
        yield b.landed
        done.append(env.now)

    env.process(cut_a())
    env.run()
    assert a.sent == pytest.approx(500_000_000) and not a.landed.triggered
    assert done == [pytest.approx(0.5 + 1.0)]  # then b's 1 GB at 1 GB/s
    assert link.bytes_sent == pytest.approx(1_500_000_000)


def test_recompute_or_wait_keeps_the_kv_off_a_slow_wan(profiles) -> None:
    """router.pdd.md_recompute on a 100 Mbit/s WAN with misses of 2,048 tokens or more: with
    md_recompute_max_tokens above them, MD prefills each miss in less time than its KV takes
    to cross, so misses go p_md with MD computing them and the WAN carries nothing; at the
    default bound (512 tokens) or off, the same workload sends its KV and RLD covers the
    transfer (MD's decode batch is never stalled by a cold prefill)."""
    slow = Wan(100e6, 0.04, 0.01)
    work = _work(requests=60, context_tokens=4096, hit_rate=0.5)
    policies = {"off": PddPolicyConfig(md_recompute=False), "default": PddPolicyConfig(),
                "unbounded": PddPolicyConfig(md_recompute_max_tokens=4096)}  # fmt: skip
    runs = {
        name: Simulation(_pdd(), profiles, slow, work, SLA, SimSettings(policy=policy)).run()
        for name, policy in policies.items()
    }
    assert runs["off"].wan_gb > 0 and runs["off"].pipelines.get("p_rld_md", 0) > 0
    assert runs["default"].wan_gb == runs["off"].wan_gb
    assert runs["default"].pipelines == runs["off"].pipelines
    assert runs["unbounded"].wan_gb == 0 and runs["unbounded"].pipelines == {"p_md": 60}
    assert runs["unbounded"].rld_token_share == 0 < runs["off"].rld_token_share


@pytest.mark.parametrize("mode", [RouterMode.COLOCATED, RouterMode.PD_LOCAL, RouterMode.PDD])
def test_what_serving_adds_to_a_request_reaches_its_ttft(profiles, mode: RouterMode) -> None:
    """A profile's ``serving`` (the router and gRPC, measured through a running pdd): each
    request waits ``request_s`` before its first worker starts it and pays ``per_new_token_s``
    on every token its prefill computes. One request on an idle fleet, cold."""
    work = Workload("one", (Conversation(0, 0.0, (Turn(4096, 16),)),))
    groups = {RouterMode.COLOCATED: (Group(Role.COLOCATED, "A", 1),),
              RouterMode.PD_LOCAL: (Group(Role.PREFILL, "A", 1), Group(Role.MAIN_DECODE, "A", 1)),
              RouterMode.PDD: _pdd(1, 1, 1).groups}[mode]  # fmt: skip
    fleet = Fleet(mode, groups)
    a = profiles["A"]
    served = dict(profiles, A=a.model_copy(update={"serving": a.serving.model_copy(
        update={"request_s": 0.25, "per_new_token_s": 1e-4})}))  # fmt: skip
    settings = SimSettings(warmup_fraction=0.0)
    base = Simulation(fleet, profiles, WAN, work, SLA, settings).run()
    slow = Simulation(fleet, served, WAN, work, SLA, settings).run()
    assert slow.ttft_p50_s - base.ttft_p50_s == pytest.approx(0.25 + 4096 * 1e-4, abs=2e-3)
