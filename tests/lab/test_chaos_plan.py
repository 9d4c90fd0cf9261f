"""The lab's WAN chaos decisions (pdd.lab.chaos), pure: seeded draws, no namespaces."""

from __future__ import annotations

import random

import pytest

from pdd.config.lab import LabConfig
from pdd.lab.chaos import PacketChaos, Schedule, chaos_summary
from pdd.lab.plan import LabPlan


def chaos(reverse: bool = False, **cfg) -> PacketChaos:
    c = LabConfig(**cfg)
    rng = random.Random(7)
    return PacketChaos(c, reverse, Schedule(c, 0.0, rng), rng)


def draws(pc: PacketChaos, n: int = 20_000, now: float = 0.0):
    return [pc.verdict(now) for _ in range(n)]


def test_no_chaos_delivers_every_packet_once_in_order_on_time():
    assert set(draws(chaos(), 1000)) == {draws(chaos(), 1)[0]}
    v = draws(chaos(), 1)[0]
    assert (v.copies, v.extra_delay_s, v.keep_order) == (1, 0.0, True)
    assert chaos_summary(LabConfig()) == ""


def test_asymmetric_loss_drops_its_own_fraction_per_direction():
    fwd = draws(chaos(loss=0.0, loss_b_to_a=0.3))
    rev = draws(chaos(True, loss=0.0, loss_b_to_a=0.3))
    assert sum(v.copies == 0 for v in fwd) == 0
    assert 0.28 < sum(v.copies == 0 for v in rev) / len(rev) < 0.32


def test_jitter_duplicates_and_reordering():
    vs = draws(chaos(jitter_ms=10, duplicate=0.1, reorder=0.2, reorder_ms=5))
    extra = [v.extra_delay_s for v in vs if v.keep_order]
    assert 0 <= min(extra) and max(extra) <= 0.010 and 0.0045 < sum(extra) / len(extra) < 0.0055
    assert 0.09 < sum(v.copies == 2 for v in vs) / len(vs) < 0.11
    held = [v for v in vs if not v.keep_order]
    assert 0.19 < len(held) / len(vs) < 0.21
    assert all(0.005 <= v.extra_delay_s <= 0.015 for v in held)


def test_the_link_flaps_once_per_period_for_the_drawn_outage():
    cfg = LabConfig(flap_every_s=10, flap_down_s=(1, 3))
    sched = Schedule(cfg, 100.0, random.Random(1))
    up = [sched.link_up(100 + t / 10) for t in range(0, 600)]  # 60 s in 0.1 s steps
    outages = [i for i in range(1, len(up)) if up[i - 1] and not up[i]]
    assert len(outages) == 6  # one per 10 s period
    for k, start in enumerate(outages):
        end = next(i for i in range(start, len(up)) if up[i])
        assert 10 * k + 7 <= start / 10 < 10 * (k + 1)  # in its own period, after its up time
        assert 0.9 <= (end - start) / 10 <= 3.1
    assert not PacketChaos(cfg, False, sched, random.Random()).verdict(100 + outages[0] / 10).copies


def test_rate_factors_cycle_and_the_kernel_allows_the_fastest():
    cfg = LabConfig(rate_mbit=100, rate_factors=(1, 0.25), rate_change_every_s=5)
    sched = Schedule(cfg, 0.0, random.Random())
    assert [sched.rate_factor(t) for t in (0, 4.9, 5, 9.9, 10, 15)] == [1, 1, 0.25, 0.25, 1, 0.25]
    assert sched.paced and LabPlan.from_config(cfg).tbf_rate_bytes_s == 100e6 / 8
    faster = LabConfig(rate_mbit=100, rate_factors=(0.5, 2))
    assert LabPlan.from_config(faster).tbf_rate_bytes_s == 200e6 / 8


def test_bad_chaos_options_are_refused():
    with pytest.raises(ValueError, match="does not fit in flap_every_s"):
        LabConfig(flap_every_s=4, flap_down_s=(1, 5))
    with pytest.raises(ValueError, match="rate_factors"):
        LabConfig(rate_factors=(1, 0))
    with pytest.raises(ValueError, match="flap_down_s"):
        LabConfig(flap_down_s=(3, 1))
