"""What only the TCP (WAN) transport promises: TLS, streams, estimates, bounded in-flight."""

from __future__ import annotations

import shutil

import pytest

from pdd.config.transfer import TransferConfig
from pdd.transfer import KVSegment, LinkEstimate, SendRequest, TransferState
from pdd.transfer.estimate import LinkEstimator, chunk_bytes_for
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
    # 100 Mbit, 20 ms: 12.5 MB/s / 4 streams x 10 ms = 31,250 B -> the 32 KiB floor
    assert chunk_bytes_for(LinkEstimate(100e6, 0.02, 5), 4, cfg) == 32 * KiB
    assert chunk_bytes_for(LinkEstimate(1e9, 0.02, 5), 4, cfg) == 4 * 64 * KiB  # 312,500 B
    # 10 Gbit, 20 ms: 1.25 GB/s / 4 streams x 10 ms = 3,125,000 B -> 47 x 64 KiB
    assert chunk_bytes_for(LinkEstimate(10e9, 0.02, 5), 4, cfg) == 47 * 64 * KiB


def test_estimator_measures_busy_time_only():
    est = LinkEstimator(alpha=1.0, interval_s=0.05)
    est.on_send(10_000_000, now=0.0)
    est.on_ack(10_000_000, now=0.1)  # 10 MB in 0.1 s busy: 800 Mbit/s
    est.on_send(10_000_000, now=5.0)  # 4.9 s idle in between: not counted
    est.on_ack(10_000_000, now=5.1)
    est.on_rtt(0.02)
    est.on_rtt(0.03)  # the minimum is the path's RTT
    got = est.estimate()
    assert (round(got.bandwidth_bps), got.rtt_s, got.samples) == (800_000_000, 0.02, 2)
