"""The UCX KV receiver (RelayDecode's) refuses a sender that cannot prove the worker token,
and stays healthy: a sender with the token delivers right after."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdd.config.transfer import TransferConfig
from pdd.transfer import KVSegment, ReceiverHooks, SendRequest, TransferState, create_transport
from pdd.transfer.testing import LandingZone, crc_of, pattern
from pdd.transfer.ucx_auth import hello_proof, proof_ok, set_kv_token
from tests.transfer.helpers import idle, wait_for

pytest.importorskip("ucxx")
pytestmark = pytest.mark.timeout(60)
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
TOKEN = b"wk-ucx-test-0123456789abcdef"
MiB = 1 << 20


def test_proof_is_bound_to_the_token_and_the_sender():
    proof = hello_proof(TOKEN, 42)
    assert proof.dtype == np.uint64 and proof.shape == (4,)
    assert proof_ok(TOKEN, 42, proof)
    assert not proof_ok(TOKEN, 43, proof)  # another sender id
    assert not proof_ok(b"another-token-of-16+", 42, proof)
    assert not proof_ok(TOKEN, 42, hello_proof(None, 42))  # zeros: no token
    assert proof_ok(None, 42, hello_proof(None, 42))  # a receiver without a token admits all
    assert TOKEN not in proof.tobytes()


def _transport(token: bytes | None, hooks: ReceiverHooks | None = None):
    set_kv_token(token)  # what the worker's composition root does
    try:
        t = create_transport("ucx", TransferConfig(deadline_s=10), hooks=hooks)
    finally:
        set_kv_token(None)
    t.start()
    return t


@pytest.mark.parametrize("intruder_token", [None, b"wk-ucx-wrong-token-000000"])
def test_a_sender_without_the_credential_is_refused_and_the_receiver_stays_healthy(
    intruder_token,
):
    zone = LandingZone()
    receiver = _transport(TOKEN, ReceiverHooks(zone))
    transports = [receiver]
    try:
        intruder = _transport(intruder_token)
        transports.append(intruder)
        handle = intruder.send(receiver.address, SendRequest("x", [KVSegment(pattern(2, MiB))]))
        status = handle.wait(20)
        assert status.state is TransferState.FAILED
        assert "handshake" in status.reason or "lost" in status.reason
        assert zone.headers == []  # not one chunk reached the allocator
        assert receiver._receiver.refused == 1

        friend = _transport(TOKEN)
        transports.append(friend)
        data = pattern(3, 3 * MiB)
        ok = friend.send(receiver.address, SendRequest("ok", [KVSegment(data)]))
        assert ok.wait(20).state is TransferState.DONE
        assert crc_of(zone.take(ok.transfer_id)[0]) == crc_of(data)
        for t in transports:
            wait_for(lambda t=t: idle(t), 10, "transport idle")
    finally:
        zone.gate.set()
        for t in reversed(transports):
            t.close()
    assert [t.stats().threads for t in transports] == [0] * len(transports)
