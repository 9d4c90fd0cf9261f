"""KV codecs for the wire: what a chunk's payload is encoded with, and how to undo it.

A chunk header names its codec (`ChunkHeader.codec`) and both sizes: `nbytes` is the raw KV
the receiver lands (and allocates), `wire_nbytes` what crosses the link. The checksum covers
the wire bytes, so a corrupted payload is refused before anything is decoded; a payload that
passes the checksum but does not decode to exactly `nbytes` (a truncated or forged frame)
raises `CodecError`, and the chunk fails like a checksum mismatch. Either way nothing is
written into the receiver's buffer that could be mistaken for KV: the transfer fails and the
receiver recomputes.

    none       raw bytes
    zstd, lz4  lossless; float data is byte-shuffled first (byte k of every element together:
               the exponent bytes of KV are nearly constant, the mantissa bytes are noise)
    int8       lossy: every group of `head_dim` consecutive elements (one token's K, or its V,
               of one head: vLLM's CPU layer block is [kv_heads, block_size, 2*head_dim]) gets
               its own absmax scale (float16), values round to int8. Payload:
               [scales f16 x groups][codes i8 x elements]. Decoded into the header's dtype.
    int8+zstd  int8, then zstd over its payload

A lossy codec needs a float `dtype` and a `shape` whose last dim is 2*head_dim (the header's
fields); a chunk without them, or not made of whole groups, is sent with the codec's lossless
part only (int8+zstd -> zstd, int8 -> none): the header of every chunk says what it carries.
Encoders run on transport threads (beside vLLM's step, never inside it); zstd and lz4 release
the GIL, numpy does for the large array operations.
"""

from __future__ import annotations

import enum

import lz4.block
import numpy as np
import zstandard

from pdd.errors import TransferError

ZSTD_LEVEL = 1  # measured: higher levels cost >3x the time for ~2% fewer bytes on KV


class CodecId(enum.IntEnum):
    NONE = 0
    ZSTD = 1
    LZ4 = 2
    INT8 = 3
    INT8_ZSTD = 4


NAMES = {"none": CodecId.NONE, "zstd": CodecId.ZSTD, "lz4": CodecId.LZ4, "int8": CodecId.INT8}
NAMES["int8+zstd"] = CodecId.INT8_ZSTD
LOSSY = (CodecId.INT8, CodecId.INT8_ZSTD)
_LOSSLESS_PART = {CodecId.INT8: CodecId.NONE, CodecId.INT8_ZSTD: CodecId.ZSTD}
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class CodecError(TransferError):
    """A payload that does not decode to its header's raw size (corrupt, truncated, forged)."""


def codec_id(name: str) -> CodecId:
    try:
        return NAMES[name]
    except KeyError:
        raise TransferError(f"unknown codec {name!r} (have {', '.join(NAMES)})") from None


def max_wire_bytes(nbytes: int) -> int:
    """The largest payload a receiver accepts for `nbytes` raw bytes (bounds its memory)."""
    return nbytes + nbytes // 64 + 4096


def group_of(dtype: str, shape: tuple[int, ...]) -> int:
    """Elements per int8 group (head_dim), or 0 when the geometry is unknown."""
    if dtype not in ELEMENT_BYTES or not shape or shape[-1] < 2 or shape[-1] % 2:
        return 0
    return shape[-1] // 2


def resolve(codec: CodecId, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int):
    """The codec a chunk really gets: a lossy one falls back where its groups do not fit."""
    if codec not in LOSSY or nbytes == 0:
        return CodecId.NONE if nbytes == 0 else codec
    group = group_of(dtype, shape)
    gbytes = group * ELEMENT_BYTES.get(dtype, 1)
    if group == 0 or offset % gbytes or nbytes % gbytes:
        return _LOSSLESS_PART[codec]
    return codec


def encode(codec: CodecId, raw: memoryview, dtype: str, shape: tuple[int, ...]):
    """Encode one chunk's raw bytes; returns a buffer (the raw view itself for NONE)."""
    if codec is CodecId.NONE:
        return raw
    if codec in LOSSY:
        packed = _int8_encode(raw, dtype, group_of(dtype, shape))
        return packed if codec is CodecId.INT8 else _zstd().compress(packed)
    data = _shuffle(raw, ELEMENT_BYTES.get(dtype, 1))
    if codec is CodecId.ZSTD:
        return _zstd().compress(data)
    return lz4.block.compress(data, store_size=False)


def decode_into(
    codec: CodecId, payload, dest: memoryview, dtype: str, shape: tuple[int, ...]
) -> None:
    """Decode `payload` into `dest` (exactly the raw size); raises CodecError otherwise."""
    n = dest.nbytes
    try:
        if codec is CodecId.NONE:
            if len(payload) != n:
                raise CodecError(f"raw payload of {len(payload)} bytes, header says {n}")
            dest[:] = payload
            return
        if codec in LOSSY:
            group = group_of(dtype, shape)
            if group == 0:
                raise CodecError(f"int8 chunk without a KV geometry ({dtype} {shape})")
            packed = payload
            if codec is CodecId.INT8_ZSTD:
                packed = _zstd_decompress(payload, _int8_size(n, dtype, group))
            _int8_decode_into(packed, dest, dtype, group)
            return
        esize = ELEMENT_BYTES.get(dtype, 1)
        if codec is CodecId.ZSTD:
            data = _zstd_decompress(payload, n)
        elif codec is CodecId.LZ4:
            data = lz4.block.decompress(bytes(payload), uncompressed_size=n)
        else:
            raise CodecError(f"unknown codec id {codec}")
        if len(data) != n:
            raise CodecError(f"payload decoded to {len(data)} bytes, header says {n}")
        _unshuffle_into(data, dest, esize)
    except (zstandard.ZstdError, lz4.block.LZ4BlockError, ValueError) as exc:
        raise CodecError(f"{codec.name} payload does not decode: {exc}") from None


# --- lossless: byte shuffle + zstd / lz4 ---------------------------------------------------


def _zstd() -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)


def _zstd_decompress(payload, n: int) -> bytes:
    out = zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=n)
    if len(out) != n:
        raise CodecError(f"zstd payload decoded to {len(out)} bytes, expected {n}")
    return out


def _shuffle(raw: memoryview, esize: int):
    """[e0b0 e0b1 e1b0 e1b1 ...] -> [e0b0 e1b0 ... | e0b1 e1b1 ...] (planes of byte k)."""
    if esize == 1 or raw.nbytes % esize:
        return raw
    a = np.frombuffer(raw, np.uint8).reshape(-1, esize)
    return np.ascontiguousarray(a.T)


def _unshuffle_into(data, dest: memoryview, esize: int) -> None:
    out = np.frombuffer(dest, np.uint8)
    src = np.frombuffer(data, np.uint8)
    if esize == 1 or out.size % esize:
        out[:] = src
        return
    out.reshape(-1, esize)[:] = src.reshape(esize, -1).T


# --- int8: absmax per group of head_dim elements -------------------------------------------


def _int8_size(nbytes: int, dtype: str, group: int) -> int:
    elements = nbytes // ELEMENT_BYTES[dtype]
    return elements + 2 * (elements // group)


def to_float32(raw, dtype: str) -> np.ndarray:
    """Raw KV bytes of `dtype` as float32 (bfloat16 is the top half of a float32)."""
    if dtype == "bfloat16":
        u16 = np.frombuffer(raw, np.uint16)
        return (u16.astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, np.float16 if dtype == "float16" else np.float32).astype(
        np.float32, copy=False
    )


def from_float32_into(values: np.ndarray, dest: memoryview, dtype: str) -> None:
    """Write float32 `values` into `dest` as `dtype` (bfloat16: round to nearest even)."""
    if dtype == "bfloat16":
        u32 = values.reshape(-1).view(np.uint32)
        rounded = u32 + (0x7FFF + ((u32 >> 16) & 1))
        np.frombuffer(dest, np.uint16)[:] = (rounded >> 16).astype(np.uint16)
        return
    out = np.frombuffer(dest, np.float16 if dtype == "float16" else np.float32)
    out[:] = values.reshape(-1)


def _int8_encode(raw: memoryview, dtype: str, group: int) -> bytes:
    x = to_float32(raw, dtype).reshape(-1, group)  # [groups, head_dim]
    scale = (np.abs(x).max(axis=1) / 127.0).astype(np.float16)  # [groups]
    s32 = scale.astype(np.float32)
    safe = np.where(s32 > 0, s32, 1.0)[:, None]
    codes = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)
    return scale.tobytes() + codes.tobytes()


def _int8_decode_into(packed, dest: memoryview, dtype: str, group: int) -> None:
    elements = dest.nbytes // ELEMENT_BYTES[dtype]
    groups = elements // group
    if len(packed) != elements + 2 * groups:
        raise CodecError(f"int8 payload of {len(packed)} bytes, expected {elements + 2 * groups}")
    buf = np.frombuffer(packed, np.uint8)
    scale = buf[: 2 * groups].view(np.float16).astype(np.float32)
    codes = buf[2 * groups :].view(np.int8).reshape(groups, group)
    from_float32_into((codes * scale[:, None]).astype(np.float32), dest, dtype)
