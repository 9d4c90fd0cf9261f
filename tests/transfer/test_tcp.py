"""What only the TCP (WAN) transport promises: TLS, streams, estimates, bounded in-flight."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pdd.config.transfer import TransferConfig
from pdd.transfer import KVSegment, LinkEstimate, SendRequest, TransferState
from pdd.transfer.api import PeerAddress
from pdd.transfer.estimate import (
    CodecLoad,
    LinkEstimator,
    chunk_bytes_for,
    plan_flow,
    socket_inflight_limit,
)
from pdd.transfer.testing import LandingZone, crc_of, make_pki, pattern
from tests.transfer.helpers import wait_for

pytestmark = pytest.mark.timeout(60)
KiB, MiB = 1 << 10, 1 << 20
SMALL = {"chunk_bytes": 64 * KiB, "min_chunk_bytes": 64 * KiB}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl command line tool not installed")
    return make_pki(str(tmp_path_factory.mktemp("pki")))


def tls(pki: dict, name: str, ca: str = "ca.pem") -> dict:
    return {
        "tls": True,
        "tls_cert_file": pki[f"{name}.pem"],
        "tls_key_file": pki[f"{name}.key"],
        "tls_ca_file": pki[ca],
    }


@contextmanager
def bare_link(probes: bool = False) -> Iterator:
    """A PeerLink to a WAN peer nobody listens at (its streams never start): what its queues
    hand out, and its warm-up's bookkeeping, without sockets."""
    from types import SimpleNamespace

    from pdd.transfer.tcp_send import PeerLink

    transport = SimpleNamespace(config=TransferConfig(), socket_bytes=2 * MiB)
    link = PeerLink(transport, PeerAddress(host="10.0.0.2", port=1, probes=probes))
    try:
        yield link
    finally:
        for s in link.streams:
            s.close_pipe()


def test_tls_with_certificates_from_the_ca_delivers(make_pair, pki):
    pair = make_pair("tcp", sender=tls(pki, "sender"), **tls(pki, "receiver"), **SMALL)
    data = pattern(1, 3 * MiB)
    handle = pair.sender.send(pair.receiver.address, SendRequest("t", [KVSegment(data)]))
    assert handle.wait(20).state is TransferState.DONE
    assert crc_of(pair.zone.take(handle.transfer_id)[0]) == crc_of(data)


@pytest.mark.parametrize("who", ["plaintext", "rogue-ca"])
def test_tls_refuses_a_sender_without_the_credential(make_pair, pki, who):
    from pdd.transfer.tcp import TcpTransport

    pair = make_pair("tcp", **tls(pki, "receiver"), **SMALL)
    cfg = {} if who == "plaintext" else tls(pki, "rogue", ca="ca.pem")
    intruder = TcpTransport(TransferConfig(**cfg, **SMALL))
    intruder.start()
    try:
        handle = intruder.send(
            pair.receiver.address, SendRequest("x", [KVSegment(pattern(2, MiB))])
        )
        status = handle.wait(20)
        assert status.state is TransferState.FAILED
        assert "lost" in status.reason
        assert pair.zone.headers == []  # not one chunk reached the allocator
    finally:
        intruder.close()
    assert intruder.stats().threads == 0


def test_parallel_streams_and_link_estimate(make_pair):
    pair = make_pair("tcp", wan_streams=3, chunk_bytes=MiB, min_chunk_bytes=64 * KiB)
    handle = pair.sender.send(
        pair.receiver.address, SendRequest("p", [KVSegment(pattern(3, 32 * MiB))])
    )
    assert handle.wait(20).state is TransferState.DONE
    # receiver: reaper + listener + one thread per stream; sender: reaper + 3 streams
    assert (pair.receiver.stats().threads, pair.sender.stats().threads) == (5, 4)
    est = pair.sender.link_estimate(pair.receiver.address)
    assert est.samples >= 1 and est.bandwidth_bps > 1e8 and 0 < est.rtt_s < 0.001
    assert pair.sender.link_estimates() == {pair.receiver.address.key(): est}


def test_in_flight_chunks_are_bounded_and_cancel_stops_them(make_pair):
    zone = LandingZone(slow_s=0.005)
    pair = make_pair("tcp", zone=zone, wan_streams=1, window_chunks=2, **SMALL)
    handle = pair.sender.send(
        pair.receiver.address, SendRequest("b", [KVSegment(pattern(4, 16 * MiB))])
    )
    wait_for(lambda: len(zone.seen(handle.transfer_id)) >= 10, 10, "ten chunks to land")
    handle.cancel()
    at_cancel = len(zone.seen(handle.transfer_id))
    assert handle.wait(10).state is TransferState.CANCELLED
    result = pair.result(handle.transfer_id)
    assert result.state is TransferState.CANCELLED
    # At most the window (2 unacknowledged chunks) plus the one being sent was still moving.
    assert len(zone.seen(handle.transfer_id)) - at_cancel <= 3


def test_chunk_size_policy():
    cfg = TransferConfig()  # 32 KiB .. 4 MiB, chunk time floor 2 ms
    assert chunk_bytes_for(None, 4, cfg) == 32 * KiB
    assert chunk_bytes_for(LinkEstimate(0.0, 20e-6, 0), 4, cfg) == 4 * MiB  # LAN
    assert chunk_bytes_for(LinkEstimate(0.0, 0.02, 0), 4, cfg) == 32 * KiB  # WAN, no rate yet
    # A chunk takes a quarter RTT per stream. 100 Mbit, 20 ms: 12.5 MB/s / 4 streams x 5 ms
    # = 15,625 B -> the 32 KiB floor
    assert chunk_bytes_for(LinkEstimate(100e6, 0.02, 5), 4, cfg) == 32 * KiB
    assert chunk_bytes_for(LinkEstimate(1e9, 0.02, 5), 4, cfg) == 2 * 64 * KiB  # 156,250 B
    # 10 Gbit, 20 ms: 1.25 GB/s / 4 streams x 5 ms = 1,562,500 B -> 23 x 64 KiB
    assert chunk_bytes_for(LinkEstimate(10e9, 0.02, 5), 4, cfg) == 23 * 64 * KiB
    # 100 Gbit, 50 ms, 32 streams: 390 MB/s x 12.5 ms -> the 4 MiB ceiling
    assert chunk_bytes_for(LinkEstimate(100e9, 0.05, 5), 32, cfg) == 4 * MiB


def test_estimator_measures_busy_time_only():
    est = LinkEstimator(alpha=1.0, interval_s=0.05)
    est.on_send(10_000_000, now=0.0)
    est.on_send(10_000_000, now=0.0)
    est.on_ack(10_000_000, now=0.02)  # the first ack starts the clock (the trip is not rate)
    est.on_ack(10_000_000, now=0.12)  # 10 MB in 0.1 s busy: 800 Mbit/s
    est.on_send(10_000_000, now=5.0)  # 4.9 s idle in between: not counted
    est.on_send(10_000_000, now=5.0)
    est.on_ack(10_000_000, now=5.5)
    est.on_ack(10_000_000, now=5.6)
    est.on_rtt(0.02)
    est.on_rtt(0.03)  # the minimum is the path's RTT
    got = est.estimate()
    assert (round(got.bandwidth_bps), got.rtt_s, got.samples) == (800_000_000, 0.02, 2)


def test_a_burst_of_late_acks_weighs_by_its_length_not_as_a_whole_interval():
    """A receiver that stalls and then acks in a burst gives a long slow interval and a short
    fast one; the estimate is their bytes over their time (time-weighted), not the mean of the
    two rates, which read the link 2.4x fast here (on the lab, a mean of rates read 1 Gbit/s
    at 1018-1159 Mbit/s; bytes over time, 990-1024)."""
    est = LinkEstimator(alpha=0.5, interval_s=0.05)
    est.on_send(30_000_000, now=0.0)
    est.on_ack(0, now=0.0)  # the clock starts
    est.on_ack(10_000_000, now=0.45)  # stalled: 10 MB in 0.45 s
    est.on_ack(10_000_000, now=0.51)  # the burst: 10 MB in 0.06 s
    got = est.estimate()
    assert got.samples == 2
    assert got.bandwidth_bps == pytest.approx(10_000_000 * 8 / 0.255)  # bytes, seconds smoothed


GBIT = 1e9


def test_the_flow_plan_covers_100_gbit_at_50_ms():
    """A tuned host (tcp_wmem/rmem maxima of 256 MiB, as ESnet advises for 100G): the plan keeps
    at least a chunk loop's bytes (2 RTTs: twice the path's BDP of 625 MB) in flight, in whole
    chunks, within the configured bounds."""
    cfg = TransferConfig()
    est = LinkEstimate(100 * GBIT, 0.05, 10)
    plan = plan_flow(est, cfg, socket_bytes=128 * MiB)
    bdp = 100 * GBIT / 8 * 0.05
    assert plan.inflight_bytes >= 2 * bdp and plan.limited_by == ""
    assert cfg.wan_streams <= plan.streams <= cfg.max_wan_streams
    assert cfg.min_chunk_bytes <= plan.chunk_bytes <= cfg.chunk_bytes
    assert plan.streams * 128 * MiB >= 2 * bdp  # no socket asked to hold more than it may
    # Linux's default 4 MiB maxima: the plan says what bounds it, and names the sysctl.
    small = plan_flow(est, cfg, socket_bytes=2 * MiB)
    assert small.streams == cfg.max_wan_streams and small.inflight_bytes < bdp
    assert "tcp_wmem" in small.limited_by


def test_the_window_grows_quickly_from_a_sane_start():
    """A link held back by its window measures window / loop as bandwidth, where a chunk's
    loop (send to ack: its trip, its own time on the wire, the ack's way back) is about two
    RTTs; the plan still doubles the window each sample, so 100 Gbit/s x 50 ms is reached
    within a few RTTs of samples. (At 2x the BDP the window measured itself and never grew:
    the lab's first 64 MiB ran at 136-151 Mbit/s of 1 Gbit/s.)"""
    cfg, rtt, path = TransferConfig(), 0.05, 100 * GBIT
    plan = plan_flow(None, cfg, 128 * MiB)
    assert plan.streams == cfg.wan_streams and plan.window_chunks == cfg.window_chunks
    samples = 0
    while True:
        rate = min(path, plan.inflight_bytes * 8 / (2 * rtt))  # what this window can carry
        if rate >= 0.9 * path:
            break
        samples += 1
        assert samples <= 16, plan
        grown = plan_flow(LinkEstimate(rate, rtt, samples), cfg, 128 * MiB)
        assert grown.inflight_bytes >= 1.9 * plan.inflight_bytes, (plan, grown)
        plan = grown
    assert samples <= 12


def test_a_lan_keeps_the_starting_window():
    cfg = TransferConfig()
    lan = plan_flow(LinkEstimate(25 * GBIT, 30e-6, 10), cfg, 2 * MiB)
    assert (lan.streams, lan.window_chunks) == (cfg.wan_streams, cfg.window_chunks)


def test_encoders_outrun_the_link_and_grow_until_the_path_limits(monkeypatch):
    """With a codec each stream encodes its own chunks: at 10 Gbit/s, int8+zstd (wire ratio
    0.25) at 0.4 GB/s of raw KV per core needs 19 encoders (raw rate x 1.5 headroom); a link
    held back by its encoders measures their rate, and the plan grows until the path limits."""
    monkeypatch.setattr("pdd.transfer.estimate.os.cpu_count", lambda: 64)
    cfg = TransferConfig()
    load = CodecLoad("int8+zstd", encode_bps=0.4e9, wire_ratio=0.25)
    assert plan_flow(LinkEstimate(10 * GBIT, 0.02, 9), cfg, 128 * MiB, load).streams == 19
    streams, path = cfg.wan_streams, 10 * GBIT
    for _ in range(8):  # each stream carries its encoder's output: 0.1 GB/s on the wire
        measured = min(path, streams * load.encode_bps * load.wire_ratio * 8)
        streams = plan_flow(LinkEstimate(measured, 0.02, 9), cfg, 128 * MiB, load).streams
    assert measured == path and streams == 19
    unmeasured = CodecLoad("zstd", encode_bps=0.0, wire_ratio=0.85)  # no chunk encoded yet
    assert plan_flow(LinkEstimate(10 * GBIT, 0.02, 9), cfg, 128 * MiB, unmeasured) == plan_flow(
        LinkEstimate(10 * GBIT, 0.02, 9), cfg, 128 * MiB
    )


def test_a_codec_the_cores_cannot_feed_is_named(monkeypatch):
    monkeypatch.setattr("pdd.transfer.estimate.os.cpu_count", lambda: 8)
    load = CodecLoad("int8+zstd", encode_bps=0.4e9, wire_ratio=0.25)
    plan = plan_flow(LinkEstimate(10 * GBIT, 0.02, 9), TransferConfig(), 128 * MiB, load)
    assert plan.streams == 8
    assert plan.limited_by.startswith("the WAN codec int8+zstd: 8 encoder threads of 0.40 GB/s")
    lan = plan_flow(LinkEstimate(10 * GBIT, 30e-6, 9), TransferConfig(), 128 * MiB, load)
    assert lan.streams == 8  # a LAN's window stays, its encoders still must keep up


def test_socket_limit_is_half_the_smaller_kernel_maximum(tmp_path):
    (tmp_path / "tcp_wmem").write_text("4096\t16384\t4194304\n")
    (tmp_path / "tcp_rmem").write_text("4096\t131072\t33554432\n")
    assert socket_inflight_limit(tmp_path) == 2 * MiB
    assert socket_inflight_limit(tmp_path / "missing") == 2 * MiB  # Linux's default maxima


def test_a_small_transfer_goes_before_a_large_one_already_under_way():
    """A 2-chunk transfer submitted behind a 1 GiB one (256 chunks of 4 MiB) is sent next,
    before the large one's next chunk (the fewest bytes left first), not after the gigabyte;
    each transfer's chunks still leave in order."""
    from pdd.transfer.ledger import OutRecord

    with bare_link() as link:
        big = OutRecord(1, "big", link.key, list(range(256)), [], 1e9, 1 << 30)
        small = OutRecord(2, "small", link.key, [0, 1], [], 1e9, 8 * MiB)
        link.submit(big)
        first = link.take()  # a stream already took the big transfer's first chunk
        link.submit(small)
        order = [link.take() for _ in range(6)]
    assert first == (big, 0)
    assert order == [(small, 0), (small, 1), (big, 1), (big, 2), (big, 3), (big, 4)]


def test_a_deferred_transfer_takes_only_what_the_others_leave():
    """A deferred transfer (nobody waits for it: MD's prefix after RLD ended the request)
    sends nothing while another transfer has a chunk waiting, and goes on once the link is
    free again; its own chunks still leave in order."""
    from pdd.transfer.ledger import OutRecord

    with bare_link() as link:
        rest = OutRecord(1, "rest", link.key, list(range(8)), [], 1e9, 32 * MiB)
        link.submit(rest)
        assert link.take() == (rest, 0)
        rest.background = True  # Transport.defer
        turn = OutRecord(2, "next-turn", link.key, [0, 1, 2], [], 1e9, 12 * MiB)
        link.submit(turn)
        order = [link.take() for _ in range(6)]
    assert order == [(turn, 0), (turn, 1), (turn, 2), (rest, 1), (rest, 2), (rest, 3)]


def test_a_deferred_transfer_still_lands_whole(make_pair):
    """Deferring changes when chunks leave, not what arrives: a deferred 8 MiB transfer and a
    small one sent after it both land byte-exact."""
    a, b = make_pair("tcp", **SMALL), make_pair("tcp", **SMALL)
    big, small = pattern(8, MiB), pattern(1, MiB)
    rest = a.sender.send(b.receiver.address, SendRequest("rest", [KVSegment(big)]))
    rest.defer()
    turn = a.sender.send(b.receiver.address, SendRequest("turn", [KVSegment(small)]))
    assert turn.wait(20).state is TransferState.DONE
    assert rest.wait(20).state is TransferState.DONE
    assert crc_of(b.zone.take(turn.transfer_id)[0]) == crc_of(small)
    assert crc_of(b.zone.take(rest.transfer_id)[0]) == crc_of(big)


def test_a_receiver_id_served_from_another_address_gets_its_kv_there(make_pair):
    """A worker id that now answers at another address (an MD restarted elsewhere): the
    sender's cached link under that id is retired, so the KV reaches the new address and not
    one chunk goes to the old receiver, which is still alive."""
    import dataclasses

    a, b = make_pair("tcp", **SMALL), make_pair("tcp", **SMALL)
    old = dataclasses.replace(a.receiver.address, name="md")
    new = dataclasses.replace(b.receiver.address, name="md")
    data = pattern(4, MiB)
    first = a.sender.send(old, SendRequest("t1", [KVSegment(data)]))
    assert first.wait(20).state is TransferState.DONE
    second = a.sender.send(new, SendRequest("t2", [KVSegment(data)]))
    assert second.wait(20).state is TransferState.DONE
    assert crc_of(b.zone.take(second.transfer_id)[0]) == crc_of(data)
    assert {h.request_id for h in a.zone.headers} == {"t1"}
    assert a.sender.link_estimates().keys() <= {"md"}


def test_a_warmed_up_link_is_measured_before_its_first_transfer_and_lands_nothing(make_pair):
    """WarmKv's transport half: ``warm`` connects the link and probes it with bytes the
    receiver drops, so the first transfer finds a measured link (the router's estimate too);
    the probe lands nothing, ends by itself, is not repeated on a measured link, and the KV
    sent after it lands byte-exact."""
    pair = make_pair("tcp", **SMALL)
    peer = pair.receiver.address
    assert pair.sender.link_estimate(peer) is None
    assert pair.sender.warm(peer)
    wait_for(lambda: not pair.sender.warming(peer), what="the warm-up to end")
    est = pair.sender.link_estimate(peer)
    assert est is not None and est.samples >= 1 and est.bandwidth_bps > 0
    assert pair.zone.headers == []  # no chunk reached the allocator
    assert pair.receiver.stats().open_inbound == 0 and pair.sender.stats().open_outbound == 0
    assert not pair.sender.warm(peer)  # measured: nothing to probe
    data = pattern(5, 2 * MiB)
    handle = pair.sender.send(peer, SendRequest("after-warm-up", [KVSegment(data)]))
    assert handle.wait(20).state is TransferState.DONE
    assert crc_of(pair.zone.take(handle.transfer_id)[0]) == crc_of(data)


def test_a_warm_up_probes_only_what_transfers_leave_of_the_link():
    """A transfer's chunks leave before the probe's (even a deferred one's); the probe sends
    its next chunk only once nothing else waits, in the plan's chunk size, up to its budget."""
    from pdd.transfer.ledger import OutRecord

    with bare_link(probes=True) as link:
        assert link.warm(3 * link.plan.chunk_bytes)
        rest = OutRecord(1, "rest", link.key, [0, 1], [], 1e9, 8 * MiB)
        rest.background = True
        turn = OutRecord(2, "turn", link.key, [0], [], 1e9, 4 * MiB)
        link.submit(rest)
        link.submit(turn)
        order = [link.take() for _ in range(7)]
    chunk = link.plan.chunk_bytes
    assert order == [(turn, 0), (rest, 0), (rest, 1), chunk, chunk, chunk, None]
    assert link.warming  # its probes' acks are still to come


def test_a_receiver_that_does_not_drop_probes_is_never_probed():
    """An older receiver closes the connection on a PROBE (and every transfer on the link with
    it): a sender neither warms up nor keeps warm a link whose address does not say it drops
    them; one that says so gets both (keep-warm: once idle for keep_warm_s on a WAN path)."""
    for probes in (False, True):
        with bare_link(probes=probes) as link:
            link.estimator.on_rtt(0.04)  # a WAN path
            stream = link.streams[0]
            stream._last_send -= 2 * link.transport.config.keep_warm_s  # idle long enough
            assert (link.warm(8 * MiB), stream._keep_warm_due()) == (probes, probes)


def test_a_warm_up_ends_once_its_delivery_rate_stops_growing():
    """The probe goes on while each interval delivers PROBE_GROWTH more than the best so far
    (the window still limits the path) and stops after PROBE_FLAT intervals that did not."""
    from pdd.transfer.tcp_send import PROBE_FLAT, PROBE_INTERVAL_S, _Probe

    probe = _Probe(left=1 << 40, started=0.0, unacked=1000)
    now, step = 0.0, PROBE_INTERVAL_S * 1.01
    probe.on_ack(0, now, 0.02)  # the first ack starts the first interval
    for rate in (1, 2, 4, 8, 16):  # doubling: still growing
        now += step
        probe.on_ack(int(rate * MiB * step), now, 0.02)
        assert probe.left > 0
    for i in range(PROBE_FLAT):  # the path is full: the same rate again
        now += step
        probe.on_ack(int(17 * MiB * step), now, 0.02)
        assert (probe.left > 0) is (i < PROBE_FLAT - 1)


def test_queued_bytes_count_what_a_new_transfer_may_find_ahead_of_it():
    """Per peer, the open transfers' bytes not yet acknowledged (the router adds them to its
    WAN ETA); a deferred transfer goes only when nothing else waits, so it is not counted,
    and a transfer that ended is gone."""
    from pdd.transfer.ledger import OutboundLedger, OutRecord
    from pdd.transfer.wire import AckStatus

    ledger = OutboundLedger()
    a = OutRecord(1, "a", "md0", [0, 1], [], 1e9, 8 * MiB)
    b = OutRecord(2, "b", "md1", [0], [], 1e9, 1 * MiB)
    rest = OutRecord(3, "rest", "md0", [0, 1, 2, 3], [], 1e9, 32 * MiB, background=True)
    for rec in (a, b, rest):
        ledger.open(rec)
    ledger.ack(1, AckStatus.OK, 4 * MiB)
    assert ledger.queued_bytes() == {"md0": 4 * MiB, "md1": 1 * MiB}
    ledger.ack(2, AckStatus.OK, 1 * MiB)  # b's only chunk: done
    assert ledger.queued_bytes() == {"md0": 4 * MiB}
