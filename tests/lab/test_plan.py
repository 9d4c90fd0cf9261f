"""The lab's names, addresses and sizes (pure; no root needed), and the relay's delay line
on a datagram socket pair instead of TUN devices."""

from __future__ import annotations

import random
import socket
import time
from ipaddress import IPv4Address

import pytest
from pydantic import ValidationError

from pdd.config import load_config
from pdd.config.lab import LabConfig
from pdd.lab.chaos import PacketChaos, Schedule
from pdd.lab.plan import LabPlan
from pdd.lab.relay import DelayLine


def line_of(plan: LabPlan, src: int, dst: int, rng: random.Random, t0: float = 0.0) -> DelayLine:
    """One relay direction with the plan's chaos (none unless configured), seeded."""
    chaos = PacketChaos(plan.cfg, False, Schedule(plan.cfg, t0, rng), rng)
    return DelayLine("t", src, dst, plan, chaos)


def test_addresses_follow_the_subnet():
    plan = LabPlan.from_config(LabConfig(prefix="x1", subnet="10.77.5.16/28"))
    a, b = plan.dc("dc-a"), plan.dc("dc-b")
    assert (a.netns, a.host_ifname, b.netns, b.host_ifname) == (
        "x1-dc-a",
        "x1-a",
        "x1-dc-b",
        "x1-b",
    )
    ip = IPv4Address
    assert (a.wan_ip, b.wan_ip) == (ip("10.77.5.17"), ip("10.77.5.18"))
    assert (a.host_ip, a.mgmt_ip) == (ip("10.77.5.21"), ip("10.77.5.22"))
    assert (b.host_ip, b.mgmt_ip) == (ip("10.77.5.25"), ip("10.77.5.26"))
    assert plan.dc("x1-dc-b") is b


def test_default_queue_is_one_bdp_with_a_floor():
    bdp = LabPlan.from_config(LabConfig(delay_ms=10, rate_mbit=100))
    assert bdp.queue_bytes == 250_000  # 12.5 MB/s x 20 ms
    floor = LabPlan.from_config(LabConfig(delay_ms=0, rate_mbit=100, mtu=9000))
    assert floor.queue_bytes == 16 * 9000
    fixed = LabPlan.from_config(LabConfig(queue_bytes=4096))
    assert fixed.queue_bytes == 4096


def test_tbf_bucket_holds_a_packet_or_a_millisecond():
    assert LabPlan.from_config(LabConfig(rate_mbit=10)).burst_bytes == 3000
    assert LabPlan.from_config(LabConfig(rate_mbit=1000)).burst_bytes == 125_000


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefix", "Pdd"),
        ("prefix", "toolongname"),
        ("prefix", "a-b"),
        ("subnet", "10.77.0.0/29"),
        ("subnet", "8.8.8.0/24"),
        ("loss", 1.0),
        ("rate_mbit", 0),
        ("mtu", 100),
    ],
)
def test_bad_values_are_refused(field, value):
    with pytest.raises(ValidationError):
        LabConfig(**{field: value})


def test_the_lab_section_loads_from_overrides():
    cfg = load_config(None, ["lab.delay_ms=25", "lab.rate_mbit=1000", "lab.mtu=9000"]).lab
    assert (cfg.delay_ms, cfg.rate_mbit, cfg.mtu, cfg.prefix) == (25, 1000, 9000, "pdd")


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def test_delay_line_keeps_order_and_holds_each_packet_for_the_delay():
    src_w, src_r = _pair()
    dst_w, dst_r = _pair()
    plan = LabPlan.from_config(LabConfig(delay_ms=30))
    line = line_of(plan, src_r.fileno(), dst_w.fileno(), random.Random(0))
    with src_w, src_r, dst_w, dst_r:
        for i in range(5):
            src_w.send(bytes([i]) * 100)
        start = time.monotonic()
        line.pull(start)
        line.push(start + 0.029)  # not due yet
        with pytest.raises(BlockingIOError):
            dst_r.recv(200)
        line.push(start + 0.030)
        assert [dst_r.recv(200) for _ in range(5)] == [bytes([i]) * 100 for i in range(5)]
    assert (line.forwarded, line.lost, line.held) == (5, 0, 0)


def test_delay_line_drops_the_loss_fraction_with_a_seeded_generator():
    src_w, src_r = _pair()
    dst_w, dst_r = _pair()
    plan = LabPlan.from_config(LabConfig(delay_ms=0, loss=0.25))
    line = line_of(plan, src_r.fileno(), dst_w.fileno(), random.Random(7))
    expected = random.Random(7)
    kept = [i for i in range(100) if not expected.random() < 0.25]
    with src_w, src_r, dst_w, dst_r:
        for i in range(100):
            src_w.send(bytes([i]))
            line.pull(0.0)
        line.push(0.0)
        got = [dst_r.recv(8)[0] for _ in range(line.forwarded)]
    assert got == kept
    assert line.lost == 100 - len(kept)


def test_delay_line_delivers_duplicates_twice_and_lets_reordered_packets_be_overtaken():
    src_w, src_r = _pair()
    dst_w, dst_r = _pair()
    plan = LabPlan.from_config(LabConfig(delay_ms=10, duplicate=0.3, reorder=0.3, reorder_ms=5))
    line = line_of(plan, src_r.fileno(), dst_w.fileno(), random.Random(3))
    with src_w, src_r, dst_w, dst_r:
        for i in range(60):
            src_w.send(bytes([i]))
        line.pull(0.0)
        line.push(1.0)
        got = [dst_r.recv(8)[0] for _ in range(line.forwarded)]
    assert sorted(set(got)) == list(range(60))  # nothing lost
    assert len(got) == 60 + line.duplicated and line.duplicated > 0
    assert got != sorted(got)  # some were overtaken


def test_paced_delay_line_runs_at_the_current_rate_factor():
    src_w, src_r = _pair()
    dst_w, dst_r = _pair()
    cfg = LabConfig(delay_ms=0, rate_mbit=8, rate_factors=(0.5, 1), rate_change_every_s=1)
    plan = LabPlan.from_config(cfg)  # 8 Mbit/s x 0.5 for the first second: 500 kB/s
    line = line_of(plan, src_r.fileno(), dst_w.fileno(), random.Random(0))
    with src_w, src_r, dst_w, dst_r:
        for _ in range(4):
            src_w.send(bytes(1000))
        line.pull(0.0)
        dues = sorted(due for due, _, _ in line.queue)
        line.push(1.0)
    assert dues == pytest.approx([0.002, 0.004, 0.006, 0.008])  # 1,000 B at 500 kB/s each
