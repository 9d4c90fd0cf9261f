"""The one contract every transport passes (inproc, tcp, ucx).

Each test ends with the leak check of the `make_pair` fixture: no open transfers, no pinned
source buffers, no lent receive buffers, and no thread left after close().
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pdd.errors import OverloadedError, TransferCancelled
from pdd.kv_geometry import LAYOUT_CPU_PACKED
from pdd.transfer import FaultHooks, KVSegment, SendRequest, TransferState
from pdd.transfer.testing import LandingZone, crc_of, pattern, peer_to_json
from tests.transfer.helpers import KINDS, idle, wait_for

pytestmark = pytest.mark.timeout(120)
KiB, MiB = 1 << 10, 1 << 20
SMALL = {"chunk_bytes": 64 * KiB, "min_chunk_bytes": 64 * KiB, "ucx_chunk_bytes": 64 * KiB}


@pytest.fixture(params=KINDS)
def kind(request):
    if request.param == "ucx":
        pytest.importorskip("ucxx")
    return request.param


def seg(seed: int, n: int, block: int = 0) -> KVSegment:
    return KVSegment(pattern(seed, n), block, block + 1, 0, 30, "uint8", (n,))


def test_delivers_bytes_and_metadata(kind, make_pair):
    pair = make_pair(kind, **SMALL)
    kv = pattern(1, 2 * 3 * 128 * 64 * 2)
    segs = [
        KVSegment(kv, 0, 4, 0, 30, "bfloat16", (2, 3, 128, 64)),
        KVSegment(pattern(2, 200_001), 4, 9, 0, 30, "uint8", (200_001,)),
        KVSegment(pattern(3, 1), 9, 10, 2, 3, "uint8", (1,)),
    ]
    total = sum(s.data.nbytes for s in segs)
    handle = pair.sender.send(pair.receiver.address, SendRequest("req-a", segs))
    status = handle.wait(20)
    assert (status.state, status.bytes_acked, status.bytes_total) == (
        TransferState.DONE,
        total,
        total,
    )
    result = pair.result(handle.transfer_id)
    assert (result.state, result.request_id, result.bytes_received) == ("done", "req-a", total)
    landed = pair.zone.take(handle.transfer_id)
    assert [bytes(x) for x in landed] == [bytes(s.data) for s in segs]
    headers = pair.zone.seen(handle.transfer_id)
    n_chunks = 2 + 4 + 1  # 98,304 B and 200,001 B in 64 KiB chunks, then 1 B
    assert sorted(h.chunk_index for h in headers) == list(range(n_chunks))
    first = [h for h in headers if h.segment_index == 0]
    assert {(h.dtype, h.shape, h.block_start, h.block_end, h.layer_end) for h in first} == {
        ("bfloat16", (2, 3, 128, 64), 0, 4, 30)
    }
    assert {
        (h.block_start, h.layer_start, h.layer_end, h.nbytes)
        for h in headers
        if h.segment_index == 2
    } == {(9, 2, 3, 1)}


def test_chunks_land_in_order_and_before_the_last_is_sent(kind, make_pair):
    zone = LandingZone(gate_chunk=3)
    pair = make_pair(kind, zone=zone, wan_streams=1, window_chunks=2, **SMALL)
    handle = pair.sender.send(pair.receiver.address, SendRequest("r", [seg(4, 2 * MiB)]))
    wait_for(zone.gate_reached.is_set, 10, "chunk 3 to reach the receiver")
    # Pipelined: chunks 0..2 landed while the transfer (32 chunks) is still being sent.
    assert handle.state is TransferState.TRANSFERRING
    assert [h.chunk_index for h in zone.seen(handle.transfer_id)] == [0, 1, 2]
    zone.gate.set()
    assert handle.wait(20).state is TransferState.DONE
    assert [h.chunk_index for h in zone.seen(handle.transfer_id)] == list(range(32))
    assert pair.result(handle.transfer_id).state is TransferState.DONE


def test_many_concurrent_transfers(kind, make_pair):
    pair = make_pair(
        kind, chunk_bytes=256 * KiB, min_chunk_bytes=64 * KiB, ucx_chunk_bytes=256 * KiB
    )
    rng = np.random.default_rng(9)
    sizes = [int(x) for x in rng.integers(0, 3 * MiB, 24)]
    handles: dict[int, int] = {}
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(i, len(sizes), 4):
            h = pair.sender.send(
                pair.receiver.address, SendRequest(f"r{j}", [seg(100 + j, sizes[j])])
            )
            with lock:
                handles[h.transfer_id] = j

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for tid, j in handles.items():
        assert pair.sender.wait(tid, 30).state is TransferState.DONE
        assert pair.result(tid).bytes_received == sizes[j]
        landed = pair.zone.take(tid)
        assert crc_of(landed[0] if landed else b"") == crc_of(pattern(100 + j, sizes[j]))
    finished = pair.sender.poll_finished()
    assert sorted(s.transfer_id for s in finished) == sorted(handles)


def test_empty_transfers(kind, make_pair):
    pair = make_pair(kind)
    h1 = pair.sender.send(pair.receiver.address, SendRequest("none", []))
    h2 = pair.sender.send(pair.receiver.address, SendRequest("zero", [seg(1, 0)]))
    for h in (h1, h2):
        assert h.wait(10).state is TransferState.DONE
        result = pair.result(h.transfer_id)
        assert (result.state, result.bytes_received, result.chunks) == ("done", 0, 1)
        assert pair.zone.seen(h.transfer_id) == []  # no buffer asked for zero bytes


def test_cancel_mid_transfer_releases_both_sides(kind, make_pair):
    zone = LandingZone(gate_chunk=2)
    pair = make_pair(kind, zone=zone, window_chunks=2, **SMALL)
    handle = pair.sender.send(pair.receiver.address, SendRequest("c", [seg(5, 8 * MiB)]))
    wait_for(zone.gate_reached.is_set, 10, "chunk 2 to reach the receiver")
    handle.cancel()
    zone.gate.set()
    status = handle.wait(10)
    assert (status.state, status.reason) == (TransferState.CANCELLED, "cancelled by owner")
    result = pair.result(handle.transfer_id)
    assert (result.state, result.reason) == (TransferState.CANCELLED, "cancelled by sender")
    assert result.chunks < 128  # the bytes stopped: most of the 128 chunks never moved
    wait_for(lambda: idle(pair.sender) and idle(pair.receiver), 10, "both sides to release")
    # The link is still usable: late acks of the cancelled chunks gave back their window.
    for i in range(3):
        after = pair.sender.send(pair.receiver.address, SendRequest("n", [seg(20 + i, MiB)]))
        assert after.wait(10).state is TransferState.DONE


def test_deadline_fails_both_sides(kind, make_pair):
    zone = LandingZone()
    pair = make_pair(kind, zone=zone, **SMALL)
    warm = pair.sender.send(pair.receiver.address, SendRequest("w", [seg(6, 1000)]))
    assert warm.wait(10).state is TransferState.DONE  # connected: the deadline is all transfer
    zone.slow_s = 0.02  # 128 chunks x 20 ms: far beyond the 0.3 s deadline
    t0 = time.monotonic()
    req = SendRequest("d", [seg(6, 8 * MiB)], deadline_s=0.3)
    handle = pair.sender.send(pair.receiver.address, req)
    status = handle.wait(10)
    assert (status.state, status.reason) == (TransferState.FAILED, "deadline exceeded")
    assert time.monotonic() - t0 < 5.0
    result = pair.result(handle.transfer_id)
    assert result.state is TransferState.FAILED
    assert "deadline" in result.reason


def test_corrupted_chunk_is_detected_and_reported(kind, make_pair):
    faults = FaultHooks(corrupt=lambda h: h.chunk_index == 1)
    pair = make_pair(kind, faults=faults, **SMALL)
    handle = pair.sender.send(pair.receiver.address, SendRequest("x", [seg(7, 1 * MiB)]))
    status = handle.wait(10)
    assert status.state is TransferState.FAILED
    assert "integrity" in status.reason
    result = pair.result(handle.transfer_id)
    assert result.state is TransferState.FAILED
    assert "integrity check failed" in result.reason


def test_allocator_refusal_fails_the_transfer(kind, make_pair):
    def refuse(header):  # what real allocators raise: a pdd error (no room, unknown request)
        raise OverloadedError("no room for this request")

    pair = make_pair(kind)
    pair.receiver.hooks.allocate = refuse
    handle = pair.sender.send(pair.receiver.address, SendRequest("n", [seg(8, 1000)]))
    assert handle.wait(10).state is TransferState.FAILED
    result = pair.result(handle.transfer_id)
    assert (result.state, result.reason) == (
        "failed",
        "allocator refused chunk: no room for this request",
    )


def test_a_receiver_that_gave_the_kv_up_cancels_the_transfer_on_both_sides(kind, make_pair):
    # e.g. RLD after the router handed the request to MD: the rest of P's send is not a failure
    def gave_up(header):
        raise TransferCancelled("KV of 'g' is no longer wanted here (handed off to MD)")

    pair = make_pair(kind, **SMALL)
    pair.receiver.hooks.allocate = gave_up
    handle = pair.sender.send(pair.receiver.address, SendRequest("g", [seg(8, 1 * MiB)]))
    status = handle.wait(10)
    assert (status.state, status.reason) == (
        TransferState.CANCELLED,
        "receiver no longer wants the KV (its request moved on)",
    )
    result = pair.result(handle.transfer_id)
    assert (result.state, result.internal_error) == (TransferState.CANCELLED, False)
    assert "handed off to MD" in result.reason


def test_allocator_bug_is_loud_and_fails_only_its_transfer(kind, make_pair, caplog):
    def buggy(header):
        return {}[header.chunk_index]  # KeyError: a bug, not a refusal

    pair = make_pair(kind)
    allocate = pair.receiver.hooks.allocate
    pair.receiver.hooks.allocate = buggy
    handle = pair.sender.send(pair.receiver.address, SendRequest("b", [seg(8, 1000)]))
    status = handle.wait(10)
    assert status.state is TransferState.FAILED
    result = pair.result(handle.transfer_id)
    assert (result.state, result.internal_error) == ("failed", True)
    assert result.reason.startswith("internal error: KeyError")
    assert status.reason == "receiver hit an internal error (see its log)"  # from the ack
    assert pair.receiver.stats().internal_errors == 1
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)
    pair.receiver.hooks.allocate = allocate  # the receiver still serves the next transfer
    again = pair.sender.send(pair.receiver.address, SendRequest("c", [seg(8, 1000)]))
    assert again.wait(10).state is TransferState.DONE


def test_receiver_death_fails_the_sender(kind, make_pair, peers):
    pair = make_pair(kind, **SMALL)
    if kind == "inproc":
        target, kill = pair.receiver.address, pair.receiver.close
    else:
        child = peers("receiver", kind, SMALL, "--slow-ms", "20")
        target, kill = child.address, child.kill
    pair.zone.slow_s = 0.02
    handle = pair.sender.send(target, SendRequest("k", [seg(9, 8 * MiB)]))
    wait_for(lambda: handle.status().bytes_acked > 0, 30, "the first acknowledged chunk")
    kill()
    status = handle.wait(30)
    assert status.state is TransferState.FAILED
    assert 0 < status.bytes_acked < 8 * MiB


def test_sender_death_fails_the_receiver(kind, make_pair, peers):
    zone = LandingZone(slow_s=0.02)
    pair = make_pair(kind, zone=zone, **SMALL)
    if kind == "inproc":
        handle = pair.sender.send(pair.receiver.address, SendRequest("s", [seg(10, 8 * MiB)]))
        tid, kill = handle.transfer_id, pair.sender.close
    else:
        child = peers("sender", kind, SMALL)
        cmd = {"cmd": "send", "peer": peer_to_json(pair.receiver.address), "nbytes": 8 * MiB}
        tid, kill = child.ask({**cmd, "seed": 10})["transfer_id"], child.kill
    wait_for(lambda: zone.seen(tid), 30, "the first chunk from the sender")
    kill()
    result = pair.result(tid, timeout_s=30)
    assert result.state is TransferState.FAILED
    assert result.chunks < 128  # chunk 0 itself may fail: the sender died mid-chunk


def test_close_with_open_transfers_releases_everything(kind, make_pair):
    zone = LandingZone(gate_chunk=1)
    pair = make_pair(kind, zone=zone, **SMALL)
    handle = pair.sender.send(pair.receiver.address, SendRequest("o", [seg(11, 4 * MiB)]))
    wait_for(zone.gate_reached.is_set, 10, "chunk 1 to reach the receiver")
    threading.Timer(0.2, zone.gate.set).start()  # let the blocked chunk finish
    pair.sender.close()
    status = handle.status()
    assert (status.state, status.reason) == (TransferState.FAILED, "transport closed")
    assert pair.sender.stats().threads == 0
    assert pair.result(handle.transfer_id).state is TransferState.FAILED


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module")
def gib():
    """1 GiB source and destination, shared by the transports (first-touch faults cost ~s)."""
    if _mem_available() < 6 << 30:
        pytest.skip("needs ~3 GiB free for source and destination")
    src = np.empty(1 << 30, np.uint8)
    src.reshape(1024, MiB)[:] = pattern(12, MiB)
    return src, np.zeros_like(src)


def test_one_gib_transfer(kind, make_pair, gib):
    src, dest = gib
    dest[:] = 0

    def land(h):
        return memoryview(dest)[h.offset : h.offset + h.nbytes]

    zone = LandingZone()
    pair = make_pair(kind, zone=zone, deadline_s=60)
    pair.receiver.hooks.allocate = land
    handle = pair.sender.send(pair.receiver.address, SendRequest("g", [KVSegment(src)]))
    assert handle.wait(60).state is TransferState.DONE
    assert pair.result(handle.transfer_id).bytes_received == 1 << 30
    assert crc_of(dest) == crc_of(src)


# --- codecs (issue 17): the WAN transports encode on their threads, the receiver decodes ---

CODED_KINDS = ["inproc", "tcp"]  # ucx sends raw only (the P -> RLD path)
KV_SHAPE = (2, 3, 128, 128)  # layers x [kv_heads, block_size, 2 * head_dim]


def kv_segment(seed: int) -> KVSegment:
    """bfloat16 KV-like values (channels of their own scale) in vLLM's CPU block layout: per
    layer and KV head, K transposed [64, 128] (a row per channel), then V [128, 64]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 2, 64, 128)).astype(np.float32)
    x[:, :, 0] *= np.linspace(0.1, 4, 64)[:, None]  # key channels (rows of K^T)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    return KVSegment(bf16, 0, 1, 0, 2, "bfloat16", KV_SHAPE, layout=LAYOUT_CPU_PACKED)


@pytest.mark.parametrize("codec", ["zstd", "lz4", "int8", "int8+zstd", "fp8", "fp8+zstd"])
@pytest.mark.parametrize("coded_kind", CODED_KINDS)
def test_codec_delivers_raw_kv_and_fewer_wire_bytes(coded_kind, codec, make_pair):
    from pdd.transfer.codec import NAMES, to_float32

    pair = make_pair(coded_kind, wan_codec=codec, **SMALL)
    kv = kv_segment(11)
    handle = pair.sender.send(pair.receiver.address, SendRequest("c", [kv]))
    status = handle.wait(20)
    assert (status.state, status.bytes_acked) == (TransferState.DONE, kv.data.nbytes)
    (landed,) = pair.zone.take(handle.transfer_id)
    headers = pair.zone.seen(handle.transfer_id)
    assert {h.codec for h in headers} == {NAMES[codec]}
    assert sum(h.nbytes for h in headers) == kv.data.nbytes
    bound = 0.55 if codec[1:4] in ("nt8", "p8") else 0.95  # random values: little to squeeze
    assert sum(h.wire_nbytes for h in headers) < bound * kv.data.nbytes
    assert status.wire_bytes == sum(h.wire_nbytes for h in headers)  # what crossed
    load = pair.sender.codec_load(pair.receiver.address)  # what sizes the link's encoders
    assert load.name == codec and load.encode_bps > 0
    if codec in ("zstd", "lz4"):
        assert bytes(landed) == kv.data.tobytes()  # lossless: exact
        return
    # 8-bit: every row (a key channel over the block, a value's head_dim) within half a
    # step of its own absmax (int8: absmax/127; fp8: 3 mantissa bits, relative)
    want = to_float32(kv.data.tobytes(), "bfloat16").reshape(-1, 64, 128)
    got = to_float32(bytes(landed), "bfloat16").reshape(-1, 64, 128)
    want_rows = want.reshape(2, 3, 2, -1)  # K^T rows of 128 tokens, V rows of 64 channels
    k_rows, v_rows = want_rows[:, :, 0].reshape(-1, 128), want_rows[:, :, 1].reshape(-1, 64)
    got_rows = got.reshape(2, 3, 2, -1)
    gk, gv = got_rows[:, :, 0].reshape(-1, 128), got_rows[:, :, 1].reshape(-1, 64)
    for w, g in ((k_rows, gk), (v_rows, gv)):
        absmax = np.abs(w).max(axis=1, keepdims=True)
        if codec.startswith("int8"):
            step = 0.5 * absmax / 127 * 1.01
        else:
            step = np.abs(w) * 2**-4 + absmax / 448 * 2**-9
        assert np.all(np.abs(g - w) <= step + np.abs(w) / 128)


@pytest.mark.parametrize(
    "fault",
    [
        FaultHooks(corrupt=lambda h: h.chunk_index == 1),
        FaultHooks(shorten=lambda h: h.chunk_index == 1),
    ],
    ids=["corrupt", "truncated"],
)
@pytest.mark.parametrize("coded_kind", CODED_KINDS)
def test_bad_coded_chunk_is_never_decoded_into_the_buffer(coded_kind, fault, make_pair):
    pair = make_pair(coded_kind, faults=fault, wan_codec="int8+zstd", **SMALL)
    handle = pair.sender.send(pair.receiver.address, SendRequest("bad", [kv_segment(12)]))
    status = handle.wait(10)
    assert status.state is TransferState.FAILED
    assert "integrity" in status.reason
    result = pair.result(handle.transfer_id)
    assert result.state is TransferState.FAILED
    assert "integrity check failed" in result.reason
    (landed,) = pair.zone.take(handle.transfer_id)
    bad = next(h for h in pair.zone.seen(handle.transfer_id) if h.chunk_index == 1)
    assert not np.asarray(landed)[bad.offset : bad.offset + bad.nbytes].any()  # untouched


def test_unknown_codec_is_a_bad_request(make_pair):
    from pdd.errors import InvalidRequestError

    pair = make_pair("inproc")
    with pytest.raises(InvalidRequestError, match="unknown codec") as err:
        pair.sender.send(pair.receiver.address, SendRequest("u", [kv_segment(14)], codec="gz"))
    assert err.value.param == "codec"


def test_ucx_refuses_a_codec_and_sends_raw_by_default(make_pair):
    from pdd.errors import InvalidRequestError

    pair = make_pair("ucx", wan_codec="zstd", **SMALL)  # wan_codec is for TCP: ignored here
    kv = kv_segment(13)
    handle = pair.sender.send(pair.receiver.address, SendRequest("raw", [kv]))
    assert handle.wait(20).state is TransferState.DONE
    assert {h.codec for h in pair.zone.seen(handle.transfer_id)} == {0}
    with pytest.raises(InvalidRequestError, match="raw KV only"):
        pair.sender.send(pair.receiver.address, SendRequest("z", [kv], codec="zstd"))


def test_on_verified_sees_every_good_chunk_before_its_result(kind, make_pair):
    """``ReceiverHooks.on_verified``: once per chunk that landed whole and passed its checksum,
    never for a corrupted one, and always before its transfer's ``on_received`` (MD's DRC
    lands blocks from it as they arrive: pdd.main_decode.landing)."""
    faults = FaultHooks(corrupt=lambda h: h.request_id == "bad" and h.chunk_index == 1)
    pair = make_pair(kind, faults=faults, wan_streams=1, **SMALL)
    seen: list[tuple[str, int, bool]] = []
    lock = threading.Lock()

    def verified(header) -> None:
        with lock, pair._lock:
            late = any(r.transfer_id == header.transfer_id for r in pair.results)
            seen.append((header.request_id, header.chunk_index, late))

    pair.receiver.hooks.on_verified = verified
    good = pair.sender.send(pair.receiver.address, SendRequest("good", [seg(9, 1 * MiB)]))
    assert good.wait(10).state is TransferState.DONE
    pair.result(good.transfer_id)
    bad = pair.sender.send(pair.receiver.address, SendRequest("bad", [seg(10, 1 * MiB)]))
    assert bad.wait(10).state is TransferState.FAILED
    pair.result(bad.transfer_id)
    with lock:
        assert sorted(i for r, i, _ in seen if r == "good") == list(range(16))
        assert 1 not in {i for r, i, _ in seen if r == "bad"}
        assert not any(late for _, _, late in seen)
