"""KV receivers authenticate every sender connection with a fresh challenge: over TCP (MD's
WAN receiver) a sender without the token, with a wrong one, or replaying a proof recorded
on another connection is closed before one chunk lands; the receiver bounds its connections
and the time to finish a handshake; a real sender with the token delivers right after."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from pdd.config.transfer import TransferConfig
from pdd.errors import TransferError
from pdd.transfer import KVSegment, ReceiverHooks, SendRequest, TransferState, create_transport
from pdd.transfer.tcp_io import FrameReader, send_all
from pdd.transfer.testing import LandingZone, crc_of, pattern
from pdd.transfer.ucx_auth import hello_proof, new_nonce, proof_ok, set_kv_token
from pdd.transfer.wire import FrameKind, pack_auth, pack_hello
from tests.transfer.helpers import wait_for

pytestmark = pytest.mark.timeout(60)
TOKEN = b"wk-kv-test-0123456789abcdef"
MiB = 1 << 20


def test_a_proof_answers_one_challenge_only():
    a, b = new_nonce(), new_nonce()
    assert a != b and len(a) == 32
    proof = hello_proof(TOKEN, 7, a)
    assert proof_ok(TOKEN, 7, proof, a)
    assert not proof_ok(TOKEN, 7, proof, b)  # replayed on another connection
    assert not proof_ok(TOKEN, 8, proof, a)  # another sender id
    assert not proof_ok(TOKEN, 7, hello_proof(TOKEN, 7), a)  # the old static proof


def _tcp(token: bytes | None, hooks: ReceiverHooks | None = None, **cfg):
    set_kv_token(token)  # what the worker's composition root does
    try:
        t = create_transport("tcp", TransferConfig(deadline_s=10, **cfg), hooks=hooks)
    finally:
        set_kv_token(None)
    t.start()
    return t


def _raw_hello(address, proof_of=None, sender: int = 99):
    """A hand-made sender: reads the challenge, answers with ``proof_of(nonce)``; returns
    (socket, reader, the nonce it got)."""
    sock = socket.create_connection((address.host, address.port), timeout=5)
    reader = FrameReader(sock)
    kind, nonce = reader.read_frame()
    assert kind is FrameKind.CHALLENGE
    if proof_of is not None:
        send_all(sock, [pack_hello(sender, 0, 1), pack_auth(proof_of(nonce))])
    return sock, reader, nonce


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError, OSError):
        return True


@pytest.fixture(params=[8])
def receiver(request):
    zone = LandingZone()
    limit = request.param
    t = _tcp(TOKEN, ReceiverHooks(zone), first_byte_timeout_s=0.5, max_inbound_streams=limit)
    try:
        yield t, zone
    finally:
        zone.gate.set()
        t.close()


def test_tcp_refuses_no_wrong_and_replayed_proofs_then_serves_the_real_sender(receiver):
    t, zone = receiver
    # a legitimate handshake, recorded by an eavesdropper
    good, _, first_nonce = _raw_hello(t.address, lambda n: hello_proof(TOKEN, 99, n).tobytes())
    recorded = hello_proof(TOKEN, 99, first_nonce).tobytes()
    good.close()
    attempts = {
        "no token": lambda n: bytes(32),
        "wrong token": lambda n: hello_proof(b"wk-not-the-fleet-token-0", 99, n).tobytes(),
        "replayed": lambda n: recorded,
    }
    for what, proof_of in attempts.items():
        sock, _, _ = _raw_hello(t.address, proof_of)
        assert _closed(sock), what
        sock.close()
    wait_for(lambda: t.refused == 3, 5, "three refusals")
    assert zone.headers == []  # not one chunk reached the allocator
    friend = _tcp(TOKEN)
    try:
        data = pattern(5, 2 * MiB)
        ok = friend.send(t.address, SendRequest("ok", [KVSegment(data)]))
        assert ok.wait(20).state is TransferState.DONE
        assert crc_of(zone.take(ok.transfer_id)[0]) == crc_of(data)
    finally:
        friend.close()


def test_a_sender_without_the_token_fails_its_transfer(receiver):
    t, zone = receiver
    intruder = _tcp(None)
    try:
        status = intruder.send(t.address, SendRequest("x", [KVSegment(pattern(1, MiB))])).wait(20)
        assert status.state is TransferState.FAILED
        assert zone.headers == []
    finally:
        intruder.close()


@pytest.mark.parametrize("receiver", [2], indirect=True)
def test_tcp_bounds_connections_and_the_time_to_finish_a_handshake(receiver):
    t, _ = receiver
    start = time.monotonic()
    idle = [_raw_hello(t.address)[0] for _ in range(2)]  # the limit: 2, both silent
    extra = socket.create_connection((t.address.host, t.address.port), timeout=5)
    assert _closed(extra)  # closed on accept: the receiver is full
    for sock in idle:  # silent past first_byte_timeout_s: closed by the receiver
        sock.settimeout(5)
        assert _closed(sock)
    assert time.monotonic() - start < 4
    wait_for(lambda: t.refused >= 1, 5, "the full-receiver refusal")


def test_proof_words_round_trip_as_the_wire_carries_them():
    nonce = new_nonce()
    words = np.frombuffer(hello_proof(TOKEN, 3, nonce).tobytes(), np.uint64)
    assert proof_ok(TOKEN, 3, words, nonce)


def test_a_keyed_reservation_takes_chunks_only_with_its_landing_key():
    """MD with fleet credentials keys every reservation; the router hands the key to the P it
    chose (SendKv), so a sender that only knows the request id cannot fill it."""
    from dataclasses import replace

    from tests.faults.test_md_landing import chain, header, landing

    land, drc = landing()
    land.prepare("kv", chain(3), 12, lease_s=60, keyed=True)
    key = land.landing_key("kv")
    assert len(key) == 12
    for forged in ("kv", "kv#", "kv#" + "A" * 12, "kv#" + key[:-1]):
        with pytest.raises(TransferError, match="not from the P its reservation is for"):
            land.allocate(replace(header(0), request_id=forged))
    assert land.refused_chunks == 4 and drc.stats().landing_blocks == 3
    assert land.allocate(replace(header(0), request_id="kv#" + key)).nbytes == 16
    open_land, _ = landing()
    open_land.prepare("kv", chain(3), 12, lease_s=60)  # no credentials: not keyed
    assert open_land.landing_key("kv") == "" and open_land.allocate(header(0)).nbytes == 16
