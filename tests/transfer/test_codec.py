"""KV codecs (pdd.transfer.codec): lossless codecs are exact, int8 stays within its error
bound, and a payload that does not decode is refused (CodecError), never landed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.errors import TransferError
from pdd.transfer.codec import (
    CodecError,
    CodecId,
    WireRatios,
    decode_into,
    encode,
    resolve,
    to_float32,
)
from pdd.transfer.wire import ChunkHeader

SHAPE = (2, 3, 32, 128)  # layers x [kv_heads, block_size, 2 * head_dim]
LOSSLESS = [CodecId.NONE, CodecId.ZSTD, CodecId.LZ4]
LOSSY = [CodecId.INT8, CodecId.INT8_ZSTD]


def kv(dtype: str, seed: int = 0, shape=SHAPE) -> bytes:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 8, shape[-1])).astype(np.float32)
    x[0, 0, :, 5] *= 40  # an outlier key channel
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return x.astype(np.float16 if dtype == "float16" else np.float32).tobytes()


def round_trip(codec, raw: bytes, dtype: str, shape=SHAPE) -> tuple[bytes, int]:
    payload = encode(codec, memoryview(raw), dtype, shape)
    out = bytearray(len(raw))
    decode_into(codec, payload, memoryview(out), dtype, shape)
    return bytes(out), memoryview(payload).nbytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("codec", LOSSLESS)
def test_lossless_is_exact(codec, dtype):
    raw = kv(dtype)
    out, wire = round_trip(codec, raw, dtype)
    assert out == raw
    assert wire <= len(raw) * 1.01  # float16 noise may not compress: the sender then sends raw


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=5000), st.sampled_from(["uint8", "bfloat16", "float32"]))
def test_lossless_is_exact_on_any_bytes(data, dtype):
    for codec in (CodecId.ZSTD, CodecId.LZ4):  # odd sizes of a float dtype: no shuffle
        assert round_trip(codec, data, dtype, ())[0] == data


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("codec", LOSSY)
def test_int8_error_bound_keys_per_channel_values_per_token(codec, dtype):
    raw = kv(dtype, 1)
    out, wire = round_trip(codec, raw, dtype)
    want = to_float32(raw, dtype).reshape(-1, SHAPE[2], SHAPE[3])
    got = to_float32(out, dtype).reshape(want.shape)
    hd = SHAPE[3] // 2
    k_step = np.abs(want[..., :hd]).max(axis=1, keepdims=True) / 127
    v_step = np.abs(want[..., hd:]).max(axis=2, keepdims=True) / 127
    rounding = np.abs(want) * (2**-8 if dtype == "bfloat16" else 2**-11)
    assert np.all(np.abs(got[..., :hd] - want[..., :hd]) <= 0.51 * k_step + rounding[..., :hd])
    assert np.all(np.abs(got[..., hd:] - want[..., hd:]) <= 0.51 * v_step + rounding[..., hd:])
    elements = len(raw) // (4 if dtype == "float32" else 2)
    units = elements // (SHAPE[2] * SHAPE[3])
    if codec is CodecId.INT8:  # one byte per element + f16 scales (hd keys + T values per unit)
        assert wire == elements + 2 * units * (hd + SHAPE[2])


def test_int8_keeps_zeros_exact():
    raw = bytes(2 * 3 * 32 * 128 * 2)
    assert round_trip(CodecId.INT8, raw, "bfloat16")[0] == raw


def test_lossy_falls_back_without_geometry_or_whole_units():
    unit = 32 * 128 * 2  # one head of one layer of one block, bfloat16
    assert resolve(CodecId.INT8, "bfloat16", SHAPE, 0, 4 * unit) is CodecId.INT8
    assert resolve(CodecId.INT8_ZSTD, "bfloat16", SHAPE, unit, unit) is CodecId.INT8_ZSTD
    assert resolve(CodecId.INT8, "uint8", (4096,), 0, 4096) is CodecId.NONE
    assert resolve(CodecId.INT8_ZSTD, "bfloat16", (), 0, unit) is CodecId.ZSTD
    assert resolve(CodecId.INT8_ZSTD, "bfloat16", SHAPE, 128, unit) is CodecId.ZSTD
    assert resolve(CodecId.INT8, "bfloat16", SHAPE, 0, unit + 256) is CodecId.NONE
    assert resolve(CodecId.ZSTD, "uint8", (), 0, 0) is CodecId.NONE  # empty chunk: raw


@pytest.mark.parametrize("codec", [CodecId.ZSTD, CodecId.LZ4, CodecId.INT8, CodecId.INT8_ZSTD])
def test_truncated_or_garbage_payload_is_refused(codec):
    raw = kv("bfloat16", 2)
    payload = bytes(memoryview(encode(codec, memoryview(raw), "bfloat16", SHAPE)).cast("B"))
    out = bytearray(len(raw))
    for bad in (payload[: len(payload) // 2], payload[:-1], b"\x00" * 64):
        with pytest.raises(CodecError):
            decode_into(codec, bad, memoryview(out), "bfloat16", SHAPE)
    with pytest.raises(CodecError):  # decodes, but to a different raw size than the header's
        decode_into(codec, payload, memoryview(bytearray(len(raw) - 8192)), "bfloat16", SHAPE)


def test_raw_payload_of_the_wrong_size_is_refused():
    with pytest.raises(CodecError):
        decode_into(CodecId.NONE, b"abc", memoryview(bytearray(4)), "uint8", ())


def header(**kw) -> ChunkHeader:
    base = dict(transfer_id=7, request_id="r", chunk_index=0, chunk_count=1, segment_index=0,
                block_start=0, block_end=1, layer_start=0, layer_end=30, dtype="bfloat16",
                shape=SHAPE, offset=0, nbytes=49152, segment_nbytes=49152, total_bytes=49152)  # fmt: skip
    return ChunkHeader(**{**base, **kw})


def test_header_carries_codec_and_wire_size():
    h = header(codec=CodecId.INT8_ZSTD, wire_nbytes=20000)
    back = ChunkHeader.unpack(h.pack()[8:])
    assert (back.codec, back.nbytes, back.wire_nbytes, back.wire_size) == (4, 49152, 20000, 20000)
    assert ChunkHeader.unpack(header().pack()[8:]).wire_nbytes == 49152  # raw: wire = nbytes


@pytest.mark.parametrize(
    "bad",
    [
        dict(codec=9, wire_nbytes=100),
        dict(codec=0, wire_nbytes=100),
        dict(codec=1, wire_nbytes=1 << 30),
    ],
    ids=["unknown codec", "raw with another wire size", "wire size beyond the bound"],
)
def test_malformed_codec_fields_are_refused(bad):
    with pytest.raises(TransferError, match="malformed chunk header"):
        ChunkHeader.unpack(header(**bad).pack()[8:])


def test_wire_ratio_learns_from_chunks():
    ratios = WireRatios(alpha=0.5)
    assert ratios.ratio(CodecId.NONE) == 1.0
    for _ in range(20):
        ratios.observe(CodecId.ZSTD, 1000, 300)
    assert ratios.ratio(CodecId.ZSTD) == pytest.approx(0.3, abs=1e-3)
