"""Wire format of the KV transfer layer: typed frames, the chunk header, checksums, chunking.

Every frame starts with an 8-byte prefix `magic "PDDK" | version u8 | kind u8 | reads u16`,
followed by a fixed-size body per kind (`reads`: on DATA frames, the acks its sender reads,
`ACKS_*`; older senders wrote 0 there and older receivers skip it). A DATA frame's body is the
`ChunkHeader`; its payload (`nbytes` bytes) follows it directly. Over TCP a 4-byte checksum
trailer follows the payload (the header's checksum field is 0) so both sides checksum each 1
MiB slice while it is hot in cache; UCX and inproc carry the checksum in the header. The
checksum (xxh3 by default, crc32c or crc32) is named per chunk, so mixed versions interoperate.

    DATA    sender -> receiver   ChunkHeader, then payload
    ACK     receiver -> sender   (transfer_id, chunk_index, status, nbytes): one per DATA;
                                 CANCELLED (the receiver gave the KV up) only where read
    CANCEL  sender -> receiver   (transfer_id, reason): stop; chunks still in flight are dropped
    HELLO   sender -> receiver   (sender_id, stream_index, stream_count): first frame of a stream
    BYE     sender -> receiver   (sender_id): the sender is closing; its open transfers fail
    CHALLENGE receiver -> sender (32-byte nonce): TCP, first frame of a stream, fresh each time
    AUTH    sender -> receiver   (32-byte proof, pdd.transfer.ucx_auth): right after HELLO

Chunks: each segment of a request is cut into byte ranges of at most `chunk_bytes`; the
header carries the segment's block and layer range, KV-head range, dtype, shape (layers,
heads, tokens per block, 2 x head_dim: so the token range too) and paged layout, the byte
offset of the chunk inside its segment and its checksum, so the receiver can place and verify
every chunk on its own, in any arrival order, and refuse KV that is not in its own geometry
(pdd.worker.inbound.KvWireCheck).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdd.errors import InvalidRequestError, TransferError
from pdd.transfer.codec import CodecId, decode_into, encode, max_wire_bytes, resolve

# Integrity check speeds measured here (idle, one core): xxh3_64 32 GiB/s on 64 MiB (72 on
# a cache-hot 4 MiB chunk), crc32c 15 (28 hot), zlib.crc32 6.4. Checksumming every byte on
# both sides is what separates a transport from raw memory copies, so the fastest wins.
try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - declared dependency; fall back to CRCs
    _xxhash = None
try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - declared dependency; fall back to zlib
    _crc32c = None

MAGIC = b"PDDK"
VERSION = 2  # 2: the KV description (heads, layout) joined the DATA header
MAX_DIMS = 8
REQUEST_ID_BYTES = 64
DTYPE_BYTES = 16
LAYOUT_BYTES = 16


class FrameKind(enum.IntEnum):
    DATA = 1
    ACK = 2
    CANCEL = 3
    HELLO = 4
    BYE = 5
    CHALLENGE = 6
    AUTH = 7
    PROBE = 8  # TCP warm-up: that many bytes follow, which the receiver drops and acks


class AckStatus(enum.IntEnum):
    OK = 0
    CHECKSUM = 1  # payload did not match its checksum: the chunk was discarded
    REFUSED = 2  # the allocator refused the chunk (no room, unknown request)
    GONE = 3  # the transfer is no longer open on the receiver (cancelled, expired, failed)
    INTERNAL = 4  # the receiver hit a bug landing the chunk (logged there with its traceback)
    CODEC = 5  # payload passed its checksum but did not decode to its raw size: discarded
    CANCELLED = 6  # the receiver's owner gave the KV up (its request moved on): not a failure
    # (sent only to senders whose DATA frames say they read it: ACKS_CANCELLED)


class CancelReason(enum.IntEnum):
    OWNER = 0  # the sender's owner cancelled (receiver reports CANCELLED)
    DEADLINE = 1  # the sender's deadline passed (receiver reports FAILED)


class ChecksumAlgo(enum.IntEnum):
    NONE = 0
    CRC32C = 1
    CRC32 = 2
    XXH3 = 3  # low 32 bits of xxh3_64


def default_checksum_algo(name: str = "xxh3") -> ChecksumAlgo:
    """The algorithm a sender uses (the best installed one at or below `name`); the
    receiver follows whatever each header names."""
    if name == "none":
        return ChecksumAlgo.NONE
    if name == "xxh3" and _xxhash is not None:
        return ChecksumAlgo.XXH3
    if name in ("xxh3", "crc32c") and _crc32c is not None:
        return ChecksumAlgo.CRC32C
    return ChecksumAlgo.CRC32


class Hasher:
    """Incremental checksum over slices; equals `checksum` of the concatenation."""

    def __init__(self, algo: ChecksumAlgo | int):
        self.algo = algo
        self._value = 0
        self._xxh = None
        if algo == ChecksumAlgo.XXH3:
            if _xxhash is None:
                raise TransferError("peer uses xxh3 but the xxhash package is not installed")
            self._xxh = _xxhash.xxh3_64()
        elif algo == ChecksumAlgo.CRC32C and _crc32c is None:
            raise TransferError("peer uses crc32c but the crc32c package is not installed")

    def update(self, data: Any) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        elif self.algo == ChecksumAlgo.CRC32C:
            self._value = _crc32c.crc32c(data, self._value)
        elif self.algo == ChecksumAlgo.CRC32:
            self._value = zlib.crc32(data, self._value)

    def digest(self) -> int:
        if self._xxh is not None:
            return self._xxh.intdigest() & 0xFFFFFFFF
        return self._value


def checksum(algo: ChecksumAlgo | int, data: Any) -> int:
    """One-shot checksum of `data` (all three release the GIL on large buffers)."""
    if algo == ChecksumAlgo.XXH3 and _xxhash is not None:
        return _xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF
    h = Hasher(algo)
    h.update(data)
    return h.digest()


TRAILER = struct.Struct("<I")  # TCP: the payload's checksum follows the payload


# magic | version | kind | what the sender reads (DATA frames: ACKS_*; 0 from older senders,
# whose 2 bytes were padding that older receivers still skip: no VERSION change)
PREFIX = struct.Struct("<4sBBH")
ACKS_CANCELLED = 1  # the sender reads AckStatus.CANCELLED (an older one: REFUSED instead)
SENDER_READS = ACKS_CANCELLED  # what this version's senders read
# The DATA body is field groups appended one after another; a new group goes at the end
# (and VERSION goes up). Version 2 appended _DATA_KV (issue 15: what the chunk carries) and
# _DATA_CODEC (issue 17: the payload's codec and its bytes on the wire).
_DATA_BASE = f"<QIIHIIHHQIQQIIBB{REQUEST_ID_BYTES}s{DTYPE_BYTES}s{MAX_DIMS}I"
_DATA_KV = f"HH{LAYOUT_BYTES}s"  # kv_head_start, kv_head_end, layout
_DATA_CODEC = "BI"  # codec, wire_nbytes
_DATA = struct.Struct(_DATA_BASE + _DATA_KV + _DATA_CODEC)
_KV_AT = 18 + MAX_DIMS  # index of the first _DATA_KV field in the unpacked tuple
_CODEC_AT = _KV_AT + 3  # index of the first _DATA_CODEC field
_ACK = struct.Struct("<QIBxxxI")
_CANCEL = struct.Struct("<QB7x")
_HELLO = struct.Struct("<QHH4x")
_BYE = struct.Struct("<Q")
_NONCE = struct.Struct("<32s")  # CHALLENGE's nonce and AUTH's proof
_PROBE = struct.Struct("<I4x")
PROBE_ID = 0  # the transfer id of a PROBE's ack (real transfer ids are never 0)
MAX_PROBE_BYTES = 64 << 20  # one PROBE frame's bytes (a sender probes in its plan's chunks)
# checksum and deadline_ms sit right after the 12 leading fields of the DATA body
_SENT = struct.Struct("<II")
_SENT_OFFSET = PREFIX.size + struct.calcsize("<QIIHIIHHQIQQ")
BODY_SIZE = {
    FrameKind.DATA: _DATA.size,
    FrameKind.ACK: _ACK.size,
    FrameKind.CANCEL: _CANCEL.size,
    FrameKind.HELLO: _HELLO.size,
    FrameKind.BYE: _BYE.size,
    FrameKind.CHALLENGE: _NONCE.size,
    FrameKind.AUTH: _NONCE.size,
    FrameKind.PROBE: _PROBE.size,
}


@dataclass(frozen=True)
class ChunkHeader:
    """Everything the receiver needs to place and verify one chunk."""

    transfer_id: int
    request_id: str
    chunk_index: int
    chunk_count: int
    segment_index: int
    block_start: int
    block_end: int
    layer_start: int
    layer_end: int
    dtype: str
    shape: tuple[int, ...]
    offset: int  # byte offset of this chunk inside its segment
    nbytes: int  # payload bytes of this chunk
    segment_nbytes: int
    total_bytes: int  # payload bytes of the whole transfer
    checksum: int = 0
    checksum_algo: int = ChecksumAlgo.XXH3
    deadline_ms: int = 0  # time left when the chunk was sent; the receiver's own deadline
    codec: int = 0  # pdd.transfer.codec.CodecId of the payload on the wire
    wire_nbytes: int = -1  # payload bytes on the wire; -1 (unset) becomes nbytes (raw)
    # The ACKS_* its sender reads (the DATA frame's prefix): how to ack it, not what it carries.
    sender_reads: int = field(default=SENDER_READS, compare=False)

    def __post_init__(self) -> None:
        if self.wire_nbytes < 0:
            object.__setattr__(self, "wire_nbytes", self.nbytes)

    @property
    def wire_size(self) -> int:
        """Bytes of this chunk's payload on the wire (nbytes is the raw KV it lands)."""
        return self.wire_nbytes

    # What the segment carries (pdd.kv_geometry): KV heads [kv_head_start, kv_head_end) and
    # the paged layout of its bytes; with block/layer ranges, dtype and shape (layers, heads,
    # tokens per block, 2 x head_dim) above. "" / 0: the sender did not say.
    kv_head_start: int = 0
    kv_head_end: int = 0
    layout: str = ""

    @property
    def token_range(self) -> tuple[int, int]:
        """Tokens [start, end) of the prompt this segment's blocks hold (shape[2] per block);
        (0, 0) when the shape does not say."""
        if len(self.shape) < 3:
            return (0, 0)
        return (self.block_start * self.shape[2], self.block_end * self.shape[2])

    def pack_sent(self, checksum: int, deadline_ms: int) -> bytes:
        """The frame as sent: the packed template with checksum and deadline patched in."""
        out = bytearray(self._template)
        _SENT.pack_into(out, _SENT_OFFSET, checksum, deadline_ms)
        return bytes(out)

    @functools.cached_property
    def _template(self) -> bytes:
        return self.pack()

    def pack(self) -> bytes:
        shape = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        body = _DATA.pack(
            self.transfer_id,
            self.chunk_index,
            self.chunk_count,
            self.segment_index,
            self.block_start,
            self.block_end,
            self.layer_start,
            self.layer_end,
            self.offset,
            self.nbytes,
            self.segment_nbytes,
            self.total_bytes,
            self.checksum,
            self.deadline_ms,
            self.checksum_algo,
            len(self.shape),
            self.request_id.encode(),
            self.dtype.encode(),
            *shape,
            self.kv_head_start,
            self.kv_head_end,
            self.layout.encode(),
            self.codec,
            self.wire_size,
        )
        return PREFIX.pack(MAGIC, VERSION, FrameKind.DATA, SENDER_READS) + body

    @classmethod
    def unpack(cls, body: bytes | memoryview, sender_reads: int = 0) -> ChunkHeader:
        """The header of a DATA frame's ``body``; ``sender_reads``: its prefix's ACKS_*."""
        f = _DATA.unpack(body)
        ndim = f[15]
        if ndim > MAX_DIMS or f[9] > f[10] or f[8] + f[9] > f[10] or f[10] > f[11]:
            raise TransferError("malformed chunk header (sizes or shape out of range)")
        codec, wire = f[_CODEC_AT], f[_CODEC_AT + 1]
        if codec not in CodecId._value2member_map_:
            raise TransferError(f"malformed chunk header: unknown codec id {codec}")
        if (codec == CodecId.NONE and wire != f[9]) or wire > max_wire_bytes(f[9]):
            raise TransferError("malformed chunk header: wire size out of range")
        return cls(
            transfer_id=f[0],
            chunk_index=f[1],
            chunk_count=f[2],
            segment_index=f[3],
            block_start=f[4],
            block_end=f[5],
            layer_start=f[6],
            layer_end=f[7],
            offset=f[8],
            nbytes=f[9],
            segment_nbytes=f[10],
            total_bytes=f[11],
            checksum=f[12],
            deadline_ms=f[13],
            checksum_algo=f[14],
            request_id=f[16].rstrip(b"\0").decode(),
            dtype=f[17].rstrip(b"\0").decode(),
            shape=tuple(f[18 : 18 + ndim]),
            kv_head_start=f[_KV_AT],
            kv_head_end=f[_KV_AT + 1],
            layout=f[_KV_AT + 2].rstrip(b"\0").decode(),
            codec=codec,
            wire_nbytes=wire,
            sender_reads=sender_reads,
        )


def pack_ack(transfer_id: int, chunk_index: int, status: AckStatus, nbytes: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, FrameKind.ACK, 0) + _ACK.pack(
        transfer_id, chunk_index, status, nbytes
    )


def ack_of(header: ChunkHeader, status: AckStatus) -> bytes:
    """The ACK frame of ``header``'s chunk, in a status its sender reads: an older sender
    is told a cancellation as REFUSED (its transfer fails, as before ACKS_CANCELLED)."""
    if status is AckStatus.CANCELLED and not header.sender_reads & ACKS_CANCELLED:
        status = AckStatus.REFUSED
    return pack_ack(header.transfer_id, header.chunk_index, status, header.nbytes)


def unpack_ack(body: bytes) -> tuple[int, int, AckStatus, int]:
    tid, idx, status, nbytes = _ACK.unpack(body)
    return tid, idx, AckStatus(status), nbytes


def pack_cancel(transfer_id: int, reason: int = 0) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, FrameKind.CANCEL, 0) + _CANCEL.pack(transfer_id, reason)


def unpack_cancel(body: bytes) -> tuple[int, CancelReason]:
    tid, reason = _CANCEL.unpack(body)
    return tid, CancelReason(
        reason
    ) if reason in CancelReason._value2member_map_ else CancelReason.OWNER


def pack_hello(sender_id: int, stream_index: int, stream_count: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, FrameKind.HELLO, 0) + _HELLO.pack(
        sender_id, stream_index, stream_count
    )


def unpack_hello(body: bytes) -> tuple[int, int, int]:
    return _HELLO.unpack(body)


def pack_challenge(nonce: bytes) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, FrameKind.CHALLENGE, 0) + _NONCE.pack(nonce)


def pack_auth(proof: bytes) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, FrameKind.AUTH, 0) + _NONCE.pack(proof)


def pack_bye(sender_id: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, FrameKind.BYE, 0) + _BYE.pack(sender_id)


def pack_probe(nbytes: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, FrameKind.PROBE, 0) + _PROBE.pack(nbytes)


def unpack_probe(body: bytes) -> int:
    return _PROBE.unpack(body)[0]


def read_prefix(prefix: bytes) -> tuple[FrameKind, int]:
    """A frame's kind and (DATA) the ACKS_* its sender reads, from one unpack of its prefix."""
    magic, version, kind, reads = PREFIX.unpack(prefix)
    if magic != MAGIC or version != VERSION:
        raise TransferError(f"bad frame prefix {bytes(prefix)!r}: not a pdd transfer peer")
    try:
        return FrameKind(kind), reads
    except ValueError:
        raise TransferError(f"unknown frame kind {kind}") from None


def unpack_prefix(prefix: bytes) -> FrameKind:
    """A frame's kind alone (the UCX sender reading its acks, where no sender_reads applies)."""
    return read_prefix(prefix)[0]


@dataclass(frozen=True)
class Chunk:
    """One planned chunk: its header (checksum not yet filled) and the source bytes."""

    header: ChunkHeader
    view: memoryview


def _as_bytes(data: Any) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidRequestError(
            f"segment data of type {type(data).__name__} is not a buffer"
        ) from None
    if not view.c_contiguous:
        raise InvalidRequestError("segment data must be C-contiguous")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


class ChunkPlan(Sequence[Chunk]):
    """The chunks of one transfer, computed on demand from the segments.

    Planning is O(segments), not O(chunks): `send` runs on the caller's thread (vLLM's
    engine core), and a multi-GB transfer in 32 KiB WAN chunks would be tens of thousands
    of objects. Chunk i of segment s covers bytes [i*chunk_bytes, ...) of that segment:

        segment 0: |c0|c1|c2|      segment 1: |c3|c4|      (an empty request: one 0-byte c0)
    """

    def __init__(self, transfer_id: int, request: Any, chunk_bytes: int, algo: int, codec: int = 0):
        _check_request(request)
        self.transfer_id, self.request = transfer_id, request
        self.chunk_bytes, self.algo, self.codec = chunk_bytes, algo, CodecId(codec)
        self.views = [_as_bytes(seg.data) for seg in request.segments]
        self.total = sum(v.nbytes for v in self.views)
        self._first: list[int] = []  # index of each segment's first chunk
        count = 0
        for view in self.views:
            self._first.append(count)
            count += -(-view.nbytes // chunk_bytes)
        self.count = max(count, 1)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Chunk:  # type: ignore[override]
        if index < 0:
            index += self.count
        if not 0 <= index < self.count:
            raise IndexError(index)
        if self.total == 0:
            si, offset, nbytes = 0, 0, 0
        else:
            si = bisect.bisect_right(self._first, index) - 1
            while self.views[si].nbytes == 0:  # empty segments own no chunk
                si -= 1
            offset = (index - self._first[si]) * self.chunk_bytes
            nbytes = min(self.chunk_bytes, self.views[si].nbytes - offset)
        seg = self.request.segments[si] if self.request.segments else None
        dtype = seg.dtype if seg else "uint8"
        shape = tuple(seg.shape) if seg else ()
        header = ChunkHeader(
            transfer_id=self.transfer_id,
            request_id=self.request.request_id,
            chunk_index=index,
            chunk_count=self.count,
            segment_index=si,
            block_start=seg.block_start if seg else 0,
            block_end=seg.block_end if seg else 0,
            layer_start=seg.layer_start if seg else 0,
            layer_end=seg.layer_end if seg else 0,
            dtype=dtype,
            shape=shape,
            offset=offset,
            nbytes=nbytes,
            segment_nbytes=self.views[si].nbytes if self.views else 0,
            total_bytes=self.total,
            checksum_algo=self.algo,
            kv_head_start=seg.kv_head_start if seg else 0,
            kv_head_end=seg.kv_head_end if seg else 0,
            layout=seg.layout if seg else "",
            codec=resolve(self.codec, dtype, shape, seg.layout if seg else "", offset, nbytes),
        )
        view = self.views[si][offset : offset + nbytes] if self.views else memoryview(b"")
        return Chunk(header, view)


def _check_request(request: Any) -> None:
    if len(request.request_id.encode()) > REQUEST_ID_BYTES:
        raise InvalidRequestError(f"request id longer than {REQUEST_ID_BYTES} bytes")
    for seg in request.segments:
        if len(seg.layout.encode()) > LAYOUT_BYTES or not 0 <= seg.kv_head_start < 1 << 16:
            raise InvalidRequestError(f"layout/heads too long for the header: {seg.layout}")
        if not 0 <= seg.kv_head_end < 1 << 16:
            raise InvalidRequestError(f"kv_head_end must fit 16 bits: {seg.kv_head_end}")
        if len(seg.dtype.encode()) > DTYPE_BYTES or len(seg.shape) > MAX_DIMS:
            raise InvalidRequestError(
                f"dtype/shape too long for the header: {seg.dtype} {seg.shape}"
            )
        if not all(0 <= d < 1 << 32 for d in seg.shape):
            raise InvalidRequestError(f"shape dimensions must fit 32 bits: {seg.shape}")


def plan_chunks(
    transfer_id: int, request: Any, chunk_bytes: int, algo: int, codec: int = 0
) -> ChunkPlan:
    """Cut every segment of `request` (a SendRequest) into chunks of at most `chunk_bytes`.

    An empty request still yields one zero-byte chunk so the receiver learns the transfer
    exists and completes it. Checksums are filled in by the sending thread, not here.
    """
    return ChunkPlan(transfer_id, request, chunk_bytes, algo, codec)


def encode_chunk(chunk: Chunk) -> tuple[ChunkHeader, memoryview]:
    """The header as sent (its wire size filled in) and the payload that crosses the wire.

    Runs on the sending transport's thread (never vLLM's): a codec other than NONE costs
    its encode time here, per chunk, as blocks stream.
    """
    header = chunk.header
    if header.codec == CodecId.NONE:
        return header, chunk.view
    data = encode(CodecId(header.codec), chunk.view, header.dtype, header.shape, header.layout)
    payload = memoryview(data).cast("B")
    if payload.nbytes >= header.nbytes:  # incompressible: raw is never worse
        return dataclasses.replace(header, codec=CodecId.NONE), chunk.view
    return dataclasses.replace(header, wire_nbytes=payload.nbytes), payload


def decode_chunk(header: ChunkHeader, payload: Any, dest: memoryview) -> None:
    """Land a verified wire payload as raw KV in `dest`; CodecError if it does not decode."""
    decode_into(CodecId(header.codec), payload, dest, header.dtype, header.shape, header.layout)
