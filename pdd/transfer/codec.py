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
    int8       lossy, 8-bit integer codes with an absmax scale per group (float16 scales)
    fp8        lossy, 8-bit float codes (e4m3, ml_dtypes) with an absmax scale per group: more
               precision near zero, less near the group's largest value, than int8
    int8+zstd, fp8+zstd   the 8-bit payload, then zstd over it

The lossy codecs treat keys and values apart, by what their statistics need: keys have
outlier *channels*, so a key's scale spans one channel over the block's tokens; a value's
spans one token's head_dim. The groups follow the bytes' paged layout (the header's `layout`,
pdd.kv_geometry): in vLLM's CPU cache (`cpu_packed_kv`: per layer and KV head, K transposed
[D, B] then V [B, D]) both are rows, one scale per row; in a K/V-split block (`kv_split`: per
layer [2, B, H, D]) keys span B, values D. Per unit (one head of one layer for the CPU
layout, one layer for K/V-split): [K scales][V scales][codes in the bytes' own order], units
concatenated. Why these groups (real KV of the default model, `pdd bench codec`; the numbers
are in docs/benchmarks.md): keys per channel and block gave 46.6 dB SNR against 39.3 dB per
token and head, with fewer scale bytes; values per token 43.2 dB.

A lossy codec needs a float `dtype`, a known layout and a `shape` (layers, heads, B, 2*D); a
chunk without them, or not made of whole units, is sent with the codec's lossless part only
(int8+zstd -> zstd, int8 -> none): the header of every chunk says what it carries. Encoders
run on transport threads (beside vLLM's step, never inside it); zstd and lz4 release the GIL,
numpy does for the large array operations.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import lz4.block
import ml_dtypes
import numpy as np
import zstandard

from pdd.errors import TransferError
from pdd.kv_geometry import LAYOUT_CPU_PACKED, LAYOUT_KV_SPLIT

ZSTD_LEVEL = 1  # measured: higher levels cost >3x the time for ~2% fewer bytes on KV


class CodecId(enum.IntEnum):
    NONE = 0
    ZSTD = 1
    LZ4 = 2
    INT8 = 3
    INT8_ZSTD = 4
    FP8 = 5
    FP8_ZSTD = 6


NAMES = {"none": CodecId.NONE, "zstd": CodecId.ZSTD, "lz4": CodecId.LZ4, "int8": CodecId.INT8}
NAMES.update({"int8+zstd": CodecId.INT8_ZSTD, "fp8": CodecId.FP8, "fp8+zstd": CodecId.FP8_ZSTD})
NAME_OF = {c: n for n, c in NAMES.items()}
LOSSY = (CodecId.INT8, CodecId.INT8_ZSTD, CodecId.FP8, CodecId.FP8_ZSTD)
_LOSSLESS_PART = {
    CodecId.INT8: CodecId.NONE,
    CodecId.INT8_ZSTD: CodecId.ZSTD,
    CodecId.FP8: CodecId.NONE,
    CodecId.FP8_ZSTD: CodecId.ZSTD,
}
_ZSTD_AFTER = (CodecId.INT8_ZSTD, CodecId.FP8_ZSTD)
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
_F16_MAX = 65504.0


# Wire/raw ratio before a codec was measured here (real KV of the default model, bf16; an
# 8-bit codec of float32 KV is about half of these).
PRIOR_RATIO = {
    CodecId.NONE: 1.0,
    CodecId.ZSTD: 0.8,
    CodecId.LZ4: 0.9,
    CodecId.INT8: 0.516,
    CodecId.INT8_ZSTD: 0.45,
    CodecId.FP8: 0.516,
    CodecId.FP8_ZSTD: 0.45,
}


class WireRatios:
    """Learned per codec (EWMAs over the chunks encoded): the wire/raw byte ratio, for ETAs,
    and the raw bytes one thread encodes per CPU second, for sizing the encoders
    (pdd.transfer.estimate.plan_flow). Thread-safe: one float store per observation under
    the GIL."""

    def __init__(self, alpha: float = 0.05):
        self._alpha = alpha
        self._ratio = dict(PRIOR_RATIO)
        self._encode_bps: dict[CodecId, float] = {}

    def observe(self, codec: CodecId, raw: int, wire: int, cpu_s: float = 0.0) -> None:
        if raw <= 0 or codec is CodecId.NONE:
            return
        old = self._ratio[codec]
        self._ratio[codec] = old + self._alpha * (wire / raw - old)
        if cpu_s > 0:
            rate = raw / cpu_s
            was = self._encode_bps.get(codec, rate)
            self._encode_bps[codec] = was + self._alpha * (rate - was)

    def ratio(self, codec: CodecId) -> float:
        return self._ratio[codec]

    def encode_bps(self, codec: CodecId) -> float:
        """Raw bytes per CPU second one encoder thread managed (0.0: not measured yet)."""
        return self._encode_bps.get(codec, 0.0)


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


@dataclass(frozen=True)
class KvUnit:
    """One quantization unit of a layout: its K half and V half as arrays, and the axis each
    scale spans (keys: the block's tokens, one scale per channel; values: head_dim, one per
    token). Shapes are per unit; a chunk of n units is viewed as (n, *shape)."""

    elements: int
    k_shape: tuple[int, ...]
    k_axis: int  # in the (n, *k_shape) view
    v_shape: tuple[int, ...]
    v_axis: int

    def halves(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Views (no copy) of the K and V halves of `flat`, whole units of any dtype."""
        u = flat.reshape(-1, 2, self.elements // 2)
        return u[:, 0].reshape(-1, *self.k_shape), u[:, 1].reshape(-1, *self.v_shape)

    def scales(self) -> tuple[int, int]:
        """Scales per unit: (keys, values)."""
        k = self.elements // 2 // self.k_shape[self.k_axis - 1]
        return k, self.elements // 2 // self.v_shape[self.v_axis - 1]


def unit_of(dtype: str, shape: tuple[int, ...], layout: str) -> KvUnit | None:
    """The lossy codecs' unit for this geometry, or None when they cannot apply."""
    if dtype not in ELEMENT_BYTES or len(shape) != 4 or shape[-1] < 2 or shape[-1] % 2:
        return None
    _, heads, tokens, width = shape
    hd = width // 2
    if layout == LAYOUT_CPU_PACKED:  # per head: K^T [D, B] rows, then V [B, D] rows
        return KvUnit(2 * tokens * hd, (hd, tokens), 2, (tokens, hd), 2)
    if layout == LAYOUT_KV_SPLIT:  # per layer: K [B, H, D] then V [B, H, D]
        kv = (tokens, heads, hd)
        return KvUnit(2 * tokens * heads * hd, kv, 1, kv, 3)
    return None


def resolve(
    codec: CodecId, dtype: str, shape: tuple[int, ...], layout: str, offset: int, nbytes: int
) -> CodecId:
    """The codec a chunk really gets: a lossy one falls back where its units do not fit."""
    if codec not in LOSSY or nbytes == 0:
        return CodecId.NONE if nbytes == 0 else codec
    unit = unit_of(dtype, shape, layout)
    ubytes = unit.elements * ELEMENT_BYTES[dtype] if unit else 0
    if ubytes == 0 or offset % ubytes or nbytes % ubytes:
        return _LOSSLESS_PART[codec]
    return codec


def encode(codec: CodecId, raw: memoryview, dtype: str, shape: tuple[int, ...], layout: str = ""):
    """Encode one chunk's raw bytes; returns a buffer (the raw view itself for NONE)."""
    if codec is CodecId.NONE:
        return raw
    if codec in LOSSY:
        unit = unit_of(dtype, shape, layout)
        if unit is None:
            raise CodecError(f"{codec.name} needs a known KV geometry ({dtype} {shape} {layout})")
        packed = _q8_encode(raw, dtype, unit, fp8=codec in (CodecId.FP8, CodecId.FP8_ZSTD))
        return _zstd().compress(packed) if codec in _ZSTD_AFTER else packed
    data = _shuffle(raw, ELEMENT_BYTES.get(dtype, 1))
    if codec is CodecId.ZSTD:
        return _zstd().compress(data)
    return lz4.block.compress(data, store_size=False)


def decode_into(
    codec: CodecId,
    payload,
    dest: memoryview,
    dtype: str,
    shape: tuple[int, ...],
    layout: str = "",
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
            unit = unit_of(dtype, shape, layout)
            if unit is None or n % (unit.elements * ELEMENT_BYTES[dtype]):
                raise CodecError(f"8-bit chunk without a whole KV geometry ({dtype} {shape})")
            packed = payload
            if codec in _ZSTD_AFTER:
                packed = _zstd_decompress(payload, _q8_size(n, dtype, unit))
            _q8_decode_into(packed, dest, dtype, unit, fp8=codec in (CodecId.FP8, CodecId.FP8_ZSTD))
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


# --- 8-bit: int8 or fp8 codes, keys per channel and block, values per token ---------------


def _q8_size(nbytes: int, dtype: str, unit: KvUnit) -> int:
    elements = nbytes // ELEMENT_BYTES[dtype]
    return elements + 2 * (elements // unit.elements) * sum(unit.scales())


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


def _quantize(x: np.ndarray, axis: int, codes: np.ndarray, fp8: bool) -> np.ndarray:
    """Codes of `x` into `codes` (a uint8 view of x's shape); returns the float16 scales."""
    qmax = FP8_MAX if fp8 else 127.0
    absmax = np.abs(x).max(axis=axis, keepdims=True)
    scale = np.minimum(absmax / qmax, _F16_MAX).astype(np.float16)
    s32 = scale.astype(np.float32)
    q = np.clip(x / np.where(s32 > 0, s32, 1.0), -qmax, qmax)
    if fp8:
        codes[...] = q.astype(FP8).view(np.uint8)
    else:
        codes.view(np.int8)[...] = np.rint(q)
    return scale


def _q8_encode(raw: memoryview, dtype: str, unit: KvUnit, fp8: bool) -> bytes:
    x = to_float32(raw, dtype)
    codes = np.empty(x.size, np.uint8)
    (k, v), (ck, cv) = unit.halves(x), unit.halves(codes)
    k_scale = _quantize(k, unit.k_axis, ck, fp8)
    v_scale = _quantize(v, unit.v_axis, cv, fp8)
    return k_scale.tobytes() + v_scale.tobytes() + codes.tobytes()


def _q8_decode_into(packed, dest: memoryview, dtype: str, unit: KvUnit, fp8: bool) -> None:
    want = _q8_size(dest.nbytes, dtype, unit)
    if len(packed) != want:
        raise CodecError(f"8-bit payload of {len(packed)} bytes, expected {want}")
    elements = dest.nbytes // ELEMENT_BYTES[dtype]
    units = elements // unit.elements
    nk, nv = (units * s for s in unit.scales())
    buf = np.frombuffer(packed, np.uint8)
    scales = buf[: 2 * (nk + nv)].view(np.float16).astype(np.float32)
    codes = buf[2 * (nk + nv) :].view(FP8 if fp8 else np.int8)
    if fp8 and np.any((buf[2 * (nk + nv) :] & 0x7F) == 0x7F):  # e4m3's NaN: never encoded
        raise CodecError("fp8 payload holds NaN codes")
    out = np.empty(elements, np.float32)
    (ok, ov), (ck, cv) = unit.halves(out), unit.halves(codes)
    np.multiply(ck.astype(np.float32), _keepdims(scales[:nk], ck.shape, unit.k_axis), out=ok)
    np.multiply(cv.astype(np.float32), _keepdims(scales[nk:], cv.shape, unit.v_axis), out=ov)
    from_float32_into(out, dest, dtype)


def _keepdims(scales: np.ndarray, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Scales laid out as absmax(..., axis, keepdims=True) of an array of `shape`."""
    return scales.reshape(shape[:axis] + (1,) + shape[axis + 1 :])
