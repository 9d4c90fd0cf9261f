"""KV codecs (pdd.transfer.codec): lossless codecs are exact, the 8-bit ones (int8, fp8) stay
within their error bound in each layout they know, and a payload that does not decode is
refused (CodecError), never landed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.errors import TransferError
from pdd.kv_geometry import LAYOUT_CPU_AMX, LAYOUT_CPU_PACKED, LAYOUT_KV_SPLIT
from pdd.transfer.codec import (
    FP8_MAX,
    CodecError,
    CodecId,
    WireRatios,
    decode_into,
    encode,
    resolve,
    to_float32,
)
from pdd.transfer.wire import ChunkHeader

L, H, B, D = 2, 3, 32, 64
SHAPE = (L, H, B, 2 * D)  # layers x [kv_heads, block_size, 2 * head_dim], as headers say
CPU = LAYOUT_CPU_PACKED
LOSSLESS = [CodecId.NONE, CodecId.ZSTD, CodecId.LZ4]
LOSSY = [CodecId.INT8, CodecId.INT8_ZSTD, CodecId.FP8, CodecId.FP8_ZSTD]


def keys_values(layout: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K as [..., channel, token] and V as [..., token, channel], whatever the layout."""
    if layout == LAYOUT_CPU_PACKED:  # per layer and head: K^T [D, B], then V [B, D]
        u = x.reshape(L, H, 2, B * D)
        return u[:, :, 0].reshape(L, H, D, B), u[:, :, 1].reshape(L, H, B, D)
    u = x.reshape(L, 2, B, H, D)  # K/V-split: per layer [2, B, H, D]
    return u[:, 0].transpose(0, 2, 3, 1), u[:, 1].transpose(0, 2, 1, 3)


def kv(dtype: str, seed: int = 0, layout: str = CPU) -> bytes:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(L * H * B * 2 * D).astype(np.float32)
    k, v = keys_values(layout, x)
    k *= rng.uniform(0.01, 8, (1, 1, D, 1)).astype(np.float32)  # channels of their own scale
    k[0, 0, 5] *= 40  # an outlier key channel
    v *= rng.uniform(0.1, 4, (1, 1, B, 1)).astype(np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return x.astype(np.float16 if dtype == "float16" else np.float32).tobytes()


def round_trip(codec, raw: bytes, dtype: str, shape=SHAPE, layout=CPU) -> tuple[bytes, int]:
    payload = encode(codec, memoryview(raw), dtype, shape, layout)
    out = bytearray(len(raw))
    decode_into(codec, payload, memoryview(out), dtype, shape, layout)
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
        assert round_trip(codec, data, dtype, (), "")[0] == data


def step_bound(codec: CodecId, want: np.ndarray, axis: int) -> np.ndarray:
    """How far a decoded value may be from `want`: half an 8-bit step of its group (int8:
    absmax/127 everywhere; fp8: relative, 3 mantissa bits) plus the float16 scale's rounding."""
    absmax = np.abs(want).max(axis=axis, keepdims=True)
    if codec in (CodecId.INT8, CodecId.INT8_ZSTD):
        return 0.5 * absmax / 127 * 1.01 + np.abs(want) * 2**-10
    subnormal = absmax / FP8_MAX * 2**-9  # e4m3's smallest step, scaled
    return np.abs(want) * (2**-4 + 2**-10) + subnormal


@pytest.mark.parametrize("layout", [LAYOUT_CPU_PACKED, LAYOUT_KV_SPLIT])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("codec", LOSSY)
def test_8bit_error_bound_keys_per_channel_values_per_token(codec, dtype, layout):
    raw = kv(dtype, 1, layout)
    out, wire = round_trip(codec, raw, dtype, SHAPE, layout)
    want_k, want_v = keys_values(layout, to_float32(raw, dtype))
    got_k, got_v = keys_values(layout, to_float32(out, dtype))
    rounding = 2**-8 if dtype == "bfloat16" else 2**-11  # writing back into the KV dtype
    k_bound = step_bound(codec, want_k, axis=-1) + np.abs(want_k) * rounding  # over tokens
    v_bound = step_bound(codec, want_v, axis=-1) + np.abs(want_v) * rounding  # over head_dim
    assert np.all(np.abs(got_k - want_k) <= k_bound)
    assert np.all(np.abs(got_v - want_v) <= v_bound)
    elements = len(raw) // (4 if dtype == "float32" else 2)
    if codec in (CodecId.INT8, CodecId.FP8):  # a byte per element + f16 scales: H*D keys and
        assert wire == elements + 2 * L * H * (D + B)  # B*H values per layer, either layout


def test_8bit_keeps_zeros_exact():
    raw = bytes(L * H * B * 2 * D * 2)
    for codec in (CodecId.INT8, CodecId.FP8):
        assert round_trip(codec, raw, "bfloat16")[0] == raw


def test_lossy_falls_back_without_geometry_or_whole_units():
    unit = B * 2 * D * 2  # one head of one layer of one block, bfloat16, CPU layout
    assert resolve(CodecId.INT8, "bfloat16", SHAPE, CPU, 0, 4 * unit) is CodecId.INT8
    assert resolve(CodecId.FP8_ZSTD, "bfloat16", SHAPE, CPU, unit, unit) is CodecId.FP8_ZSTD
    assert resolve(CodecId.INT8, "uint8", (4096,), CPU, 0, 4096) is CodecId.NONE
    assert resolve(CodecId.INT8_ZSTD, "bfloat16", (), CPU, 0, unit) is CodecId.ZSTD
    assert resolve(CodecId.INT8_ZSTD, "bfloat16", SHAPE, CPU, 128, unit) is CodecId.ZSTD
    assert resolve(CodecId.INT8, "bfloat16", SHAPE, CPU, 0, unit + 256) is CodecId.NONE
    assert resolve(CodecId.FP8, "bfloat16", SHAPE, LAYOUT_CPU_AMX, 0, unit) is CodecId.NONE
    assert resolve(CodecId.FP8, "bfloat16", SHAPE, "", 0, unit) is CodecId.NONE  # not said
    layer = H * unit  # K/V-split: the unit is a whole layer
    assert resolve(CodecId.INT8, "bfloat16", SHAPE, LAYOUT_KV_SPLIT, 0, unit) is CodecId.NONE
    assert resolve(CodecId.INT8, "bfloat16", SHAPE, LAYOUT_KV_SPLIT, 0, layer) is CodecId.INT8
    assert resolve(CodecId.ZSTD, "uint8", (), "", 0, 0) is CodecId.NONE  # empty chunk: raw


def test_fp8_nan_codes_are_refused():
    payload = bytearray(memoryview(encode(CodecId.FP8, memoryview(kv("float32")), "float32",
                                          SHAPE, CPU)).cast("B"))  # fmt: skip
    payload[-1] = 0x7F  # a code the encoder never writes
    with pytest.raises(CodecError, match="NaN"):
        decode_into(CodecId.FP8, payload, memoryview(bytearray(L * H * B * 2 * D * 4)),
                    "float32", SHAPE, CPU)  # fmt: skip


def test_an_8bit_codec_is_never_applied_to_an_unknown_layout():
    with pytest.raises(CodecError, match="known KV geometry"):
        encode(CodecId.INT8, memoryview(kv("bfloat16")), "bfloat16", SHAPE, LAYOUT_CPU_AMX)


@pytest.mark.parametrize("codec", [CodecId.ZSTD, CodecId.LZ4, *LOSSY])
def test_truncated_or_garbage_payload_is_refused(codec):
    raw = kv("bfloat16", 2)
    payload = bytes(memoryview(encode(codec, memoryview(raw), "bfloat16", SHAPE, CPU)).cast("B"))
    out = bytearray(len(raw))
    for bad in (payload[: len(payload) // 2], payload[:-1], b"\x00" * 64):
        with pytest.raises(CodecError):
            decode_into(codec, bad, memoryview(out), "bfloat16", SHAPE, CPU)
    with pytest.raises(CodecError):  # decodes, but to a different raw size than the header's
        short = memoryview(bytearray(len(raw) - 8192))
        decode_into(codec, payload, short, "bfloat16", SHAPE, CPU)


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


def test_wire_ratio_and_encode_rate_learn_from_chunks():
    ratios = WireRatios(alpha=0.5)
    assert ratios.ratio(CodecId.NONE) == 1.0
    assert ratios.encode_bps(CodecId.ZSTD) == 0.0  # nothing encoded yet
    for _ in range(20):
        ratios.observe(CodecId.ZSTD, 1000, 300, cpu_s=2e-6)
    assert ratios.ratio(CodecId.ZSTD) == pytest.approx(0.3, abs=1e-3)
    assert ratios.encode_bps(CodecId.ZSTD) == pytest.approx(5e8)
