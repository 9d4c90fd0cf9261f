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
    int8       lossy, keys and values apart (vLLM's CPU layer block is [kv_heads, block_size,
               2*head_dim], K|V packed): keys get an absmax scale per channel over the block's
               tokens (keys have outlier channels), values one per token; scales are float16.
               Per unit (one head of one layer of one block, T tokens x 2*head_dim):
               [K scales f16 x head_dim][V scales f16 x T][codes i8 x T*2*head_dim], units
               concatenated. Measured on real KV of the default model (bf16): keys per
               channel and block 46.6 dB SNR vs 39.3 dB per token and head, with half the
               key scale bytes, so keys go per channel; values per token 43.2 dB.
    int8+zstd  int8, then zstd over its payload

A lossy codec needs a float `dtype` and a `shape` ending in (block_size, 2*head_dim) (the
header's fields); a chunk without them, or not made of whole units, is sent with the codec's
lossless part only (int8+zstd -> zstd, int8 -> none): the header of every chunk says what it carries.
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


# Wire/raw ratio before a codec was measured here (real KV of the default model, bf16).
PRIOR_RATIO = {
    CodecId.NONE: 1.0,
    CodecId.ZSTD: 0.8,
    CodecId.LZ4: 0.9,
    CodecId.INT8: 0.516,
    CodecId.INT8_ZSTD: 0.45,
}


class WireRatios:
    """Learned wire/raw byte ratio per codec (an EWMA over chunks), for ETAs. Thread-safe:
    one float store per observation under the GIL."""

    def __init__(self, alpha: float = 0.05):
        self._alpha = alpha
        self._ratio = dict(PRIOR_RATIO)

    def observe(self, codec: CodecId, raw: int, wire: int) -> None:
        if raw <= 0 or codec is CodecId.NONE:
            return
        old = self._ratio[codec]
        self._ratio[codec] = old + self._alpha * (wire / raw - old)

    def ratio(self, codec: CodecId) -> float:
        return self._ratio[codec]


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


def unit_of(dtype: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(tokens, 2*head_dim) of one int8 unit, or (0, 0) when the geometry is unknown."""
    if dtype not in ELEMENT_BYTES or len(shape) < 2 or shape[-1] < 2 or shape[-1] % 2:
        return 0, 0
    return shape[-2], shape[-1]


def resolve(codec: CodecId, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int):
    """The codec a chunk really gets: a lossy one falls back where its units do not fit."""
    if codec not in LOSSY or nbytes == 0:
        return CodecId.NONE if nbytes == 0 else codec
    tokens, width = unit_of(dtype, shape)
    ubytes = tokens * width * ELEMENT_BYTES.get(dtype, 1)
    if ubytes == 0 or offset % ubytes or nbytes % ubytes:
        return _LOSSLESS_PART[codec]
    return codec


def encode(codec: CodecId, raw: memoryview, dtype: str, shape: tuple[int, ...]):
    """Encode one chunk's raw bytes; returns a buffer (the raw view itself for NONE)."""
    if codec is CodecId.NONE:
        return raw
    if codec in LOSSY:
        packed = _int8_encode(raw, dtype, unit_of(dtype, shape))
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
            unit = unit_of(dtype, shape)
            ubytes = unit[0] * unit[1] * ELEMENT_BYTES.get(dtype, 1)
            if ubytes == 0 or n % ubytes:
                raise CodecError(f"int8 chunk without a whole KV geometry ({dtype} {shape})")
            packed = payload
            if codec is CodecId.INT8_ZSTD:
                packed = _zstd_decompress(payload, _int8_size(n, dtype, unit))
            _int8_decode_into(packed, dest, dtype, unit)
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
    """[e0b0 e0b1 e1b0 e1b1 ...] -> [e0b0 e1b0 ... | e0b1 e1b1 ...] (planes of byte k).

    Strided plane copies: ~3 GB/s on one core here, twice a transpose copy."""
    if esize == 1 or raw.nbytes % esize:
        return raw
    src = np.frombuffer(raw, np.uint8)
    n = src.size // esize
    out = np.empty(src.size, np.uint8)
    for k in range(esize):
        out[k * n : (k + 1) * n] = src[k::esize]
    return out


def _unshuffle_into(data, dest: memoryview, esize: int) -> None:
    out = np.frombuffer(dest, np.uint8)
    src = np.frombuffer(data, np.uint8)
    if esize == 1 or out.size % esize:
        out[:] = src
        return
    n = out.size // esize
    for k in range(esize):
        out[k::esize] = src[k * n : (k + 1) * n]


# --- int8: keys per channel and block, values per token -----------------------------------


def _int8_size(nbytes: int, dtype: str, unit: tuple[int, int]) -> int:
    tokens, width = unit
    elements = nbytes // ELEMENT_BYTES[dtype]
    units = elements // (tokens * width)
    return elements + 2 * units * (width // 2 + tokens)


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
        u32 = np.ascontiguousarray(values, np.float32).reshape(-1).view(np.uint32)
        rounded = u32 + (0x7FFF + ((u32 >> 16) & 1))
        np.frombuffer(dest, np.uint16)[:] = (rounded >> 16).astype(np.uint16)
        return
    out = np.frombuffer(dest, np.float16 if dtype == "float16" else np.float32)
    out[:] = values.reshape(-1)


def _scale(absmax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 scales for `absmax` and their float32 values (0 -> 1: an all-zero group)."""
    scale = (absmax / 127.0).astype(np.float16)
    s32 = scale.astype(np.float32)
    return scale, np.where(s32 > 0, s32, 1.0)


def _int8_encode(raw: memoryview, dtype: str, unit: tuple[int, int]) -> bytes:
    tokens, width = unit
    hd = width // 2
    x = to_float32(raw, dtype).reshape(-1, tokens, width)  # [units, T, 2*hd]
    k, v = x[..., :hd], x[..., hd:]
    k_scale, ks = _scale(np.abs(k).max(axis=1))  # [units, hd]: per channel over the block
    v_scale, vs = _scale(np.abs(v).max(axis=2))  # [units, T]: per token
    codes = np.empty(x.shape, np.int8)
    codes[..., :hd] = np.clip(np.rint(k / ks[:, None, :]), -127, 127)
    codes[..., hd:] = np.clip(np.rint(v / vs[:, :, None]), -127, 127)
    return k_scale.tobytes() + v_scale.tobytes() + codes.tobytes()


def _int8_decode_into(packed, dest: memoryview, dtype: str, unit: tuple[int, int]) -> None:
    tokens, width = unit
    hd = width // 2
    want = _int8_size(dest.nbytes, dtype, unit)
    if len(packed) != want:
        raise CodecError(f"int8 payload of {len(packed)} bytes, expected {want}")
    units = dest.nbytes // ELEMENT_BYTES[dtype] // (tokens * width)
    buf = np.frombuffer(packed, np.uint8)
    k_end, v_end = 2 * units * hd, 2 * units * (hd + tokens)
    ks = buf[:k_end].view(np.float16).astype(np.float32).reshape(units, 1, hd)
    vs = buf[k_end:v_end].view(np.float16).astype(np.float32).reshape(units, tokens, 1)
    codes = buf[v_end:].view(np.int8).reshape(units, tokens, width)
    out = np.empty(codes.shape, np.float32)
    np.multiply(codes[..., :hd], ks, out=out[..., :hd])
    np.multiply(codes[..., hd:], vs, out=out[..., hd:])
    from_float32_into(out, dest, dtype)
