"""Wire format: the chunk header round-trips exactly; malformed frames are refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pdd.errors import InvalidRequestError, TransferError
from pdd.transfer import KVSegment, SendRequest
from pdd.transfer.wire import (
    ACKS_CANCELLED,
    PREFIX,
    AckStatus,
    ChunkHeader,
    FrameKind,
    ack_of,
    pack_ack,
    plan_chunks,
    read_prefix,
    unpack_ack,
    unpack_prefix,
)


def header(**kw) -> ChunkHeader:
    base = dict(
        transfer_id=(1 << 63) + 5,
        request_id="cmpl-" + "x" * 59,
        chunk_index=3,
        chunk_count=9,
        segment_index=1,
        block_start=128,
        block_end=160,
        layer_start=0,
        layer_end=30,
        dtype="bfloat16",
        shape=(32, 30, 3, 128, 128),
        offset=4 << 20,
        nbytes=737_280,
        segment_nbytes=23_592_960,
        total_bytes=30_000_000,
    )
    return ChunkHeader(**{**base, **kw})


def test_header_round_trips_with_checksum_and_deadline():
    h = header()
    frame = h.pack_sent(checksum=0xDEADBEEF, deadline_ms=1234)
    assert unpack_prefix(frame[: PREFIX.size]) is FrameKind.DATA
    back = ChunkHeader.unpack(frame[PREFIX.size :], read_prefix(frame[: PREFIX.size])[1])
    assert back == header(checksum=0xDEADBEEF, deadline_ms=1234)


def test_a_cancellation_is_acked_as_cancelled_only_to_a_sender_that_reads_it():
    """This version's DATA prefix says its sender reads AckStatus.CANCELLED (in 2 bytes an
    older receiver skips as padding); an older sender's prefix says nothing, and it is told
    REFUSED (its transfer fails, as it always did)."""
    frame = header().pack()
    assert struct.unpack("<4sBB2x", frame[: PREFIX.size])[2] == FrameKind.DATA  # older parse
    assert read_prefix(frame[: PREFIX.size])[1] == ACKS_CANCELLED
    older = struct.pack("<4sBB2x", *struct.unpack("<4sBB2x", frame[: PREFIX.size]))
    for prefix, told in ((frame[: PREFIX.size], AckStatus.CANCELLED), (older, AckStatus.REFUSED)):
        h = ChunkHeader.unpack(frame[PREFIX.size :], read_prefix(prefix)[1])
        ack = ack_of(h, AckStatus.CANCELLED)
        assert unpack_ack(ack[PREFIX.size :])[2] is told
        assert unpack_ack(ack_of(h, AckStatus.CHECKSUM)[PREFIX.size :])[2] is AckStatus.CHECKSUM


def test_malformed_headers_and_prefixes_are_refused():
    bad = header(nbytes=24_000_000)  # more than its segment
    with pytest.raises(TransferError, match="malformed"):
        ChunkHeader.unpack(bad.pack()[PREFIX.size :])
    with pytest.raises(TransferError, match="not a pdd transfer peer"):
        unpack_prefix(b"HTTP/1.1")
    assert unpack_prefix(pack_ack(1, 2, 0, 3)[: PREFIX.size]) is FrameKind.ACK


def test_plan_chunks_cuts_segments_and_keeps_metadata():
    a = np.zeros(250, np.uint8)
    b = np.zeros((2, 50), np.float32)  # 400 bytes, 2-D: sent as its raw bytes
    req = SendRequest("r", [KVSegment(a, 0, 2), KVSegment(b, 2, 3, 1, 4, "float32", (2, 50))])
    chunks = plan_chunks(7, req, 100, 1)
    got = [(c.header.segment_index, c.header.offset, c.header.nbytes) for c in chunks]
    assert got == [(0, 0, 100), (0, 100, 100), (0, 200, 50)] + [(1, i * 100, 100) for i in range(4)]
    assert {c.header.chunk_count for c in chunks} == {7}
    assert {c.header.total_bytes for c in chunks} == {650}
    last = chunks[-1].header
    assert (last.block_start, last.layer_start, last.layer_end, last.dtype) == (2, 1, 4, "float32")


def test_plan_is_lazy_and_skips_empty_segments():
    one = np.zeros(1, np.uint8)
    segs = [KVSegment(one), KVSegment(np.zeros(0, np.uint8)), KVSegment(one)]
    plan = plan_chunks(1, SendRequest("b", segs), 32, 1)
    assert [(c.header.segment_index, c.header.nbytes) for c in plan] == [(0, 1), (2, 1)]
    data = np.zeros(64 << 20, np.uint8)
    plan = plan_chunks(2, SendRequest("h", [KVSegment(data)]), 1024, 1)  # 65,536 chunks
    last = plan[-1].header
    assert (len(plan), last.chunk_index, last.offset, last.nbytes) == (
        65_536,
        65_535,
        (64 << 20) - 1024,
        1024,
    )


def test_plan_chunks_edge_cases():
    empty = plan_chunks(1, SendRequest("e", []), 100, 1)
    assert [(c.header.chunk_count, c.header.nbytes) for c in empty] == [(1, 0)]
    with pytest.raises(InvalidRequestError, match="C-contiguous"):
        plan_chunks(1, SendRequest("n", [KVSegment(np.zeros((4, 4))[:, 1])]), 100, 1)
    with pytest.raises(InvalidRequestError, match="longer than 64"):
        plan_chunks(1, SendRequest("r" * 65, []), 100, 1)


def test_transfer_layer_never_imports_torch_or_vllm():
    import subprocess
    import sys

    code = "import sys, pdd.transfer, pdd.transfer.tcp; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
