"""pdd.worker.kv_convert: every widening conversion (bfloat16 -> float32; fp8 -> bfloat16
and float32) round-trips bit-exactly for each layout pair, over every bit pattern of the
narrower dtype; the narrowing rounds like torch; layouts move K and V where each layout keeps
them."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
import torch

from pdd.errors import ConfigError
from pdd.kv_geometry import LAYOUT_CPU_PACKED, LAYOUT_KV_SPLIT, KvGeometry
from pdd.worker.kv_convert import FP8 as FP8_NP
from pdd.worker.kv_convert import LAYOUTS, convert_block

# 2 layers x 2 heads x 32 tokens x (2 x 128): 32,768 values per block; two blocks hold
# every bfloat16 bit pattern once.
BASE = KvGeometry(fingerprint="m" * 32, num_layers=2, total_kv_heads=2, kv_head_end=2,
                  head_dim=128, block_size=32, kv_dtype="bfloat16")  # fmt: skip
PATTERNS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def geo(dtype: str, layout: str) -> KvGeometry:
    return BASE.model_copy(update={"kv_dtype": dtype, "layout": layout})


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(LAYOUTS, LAYOUTS)))
def test_bfloat16_to_float32_and_back_is_bit_exact(src: str, dst: str):
    a, wide = geo("bfloat16", src), geo("float32", dst)
    for half in np.split(PATTERNS, 2):  # one block each
        block = half.tobytes()
        f32 = bytearray(wide.block_bytes)
        back = bytearray(a.block_bytes)
        convert_block(block, a, f32, wide)
        convert_block(f32, wide, back, a)
        assert bytes(back) == block


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(LAYOUTS, LAYOUTS)))
def test_float32_layout_changes_are_bit_exact(src: str, dst: str):
    a, b = geo("float32", src), geo("float32", dst)
    block = np.random.default_rng(1).standard_normal(a.block_bytes // 4, np.float32).tobytes()
    mid, back = bytearray(b.block_bytes), bytearray(a.block_bytes)
    convert_block(block, a, mid, b)
    convert_block(mid, b, back, a)
    assert bytes(back) == block


FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize(
    ("fp8", "wide", "src", "dst"),
    list(itertools.product(FP8, ("bfloat16", "float32"), LAYOUTS, LAYOUTS)),
)
def test_fp8_to_a_wider_dtype_and_back_is_bit_exact(fp8: str, wide: str, src: str, dst: str):
    """vLLM's fp8 KV cache (an MD or P with engine.kv_cache_dtype fp8_*): every one of the 256
    bit patterns, NaNs included, comes back from bfloat16 or float32 as it was."""
    a, w = geo(fp8, src), geo(wide, dst)
    block = np.resize(np.arange(256, dtype=np.uint8), a.block_bytes).tobytes()
    mid, back = bytearray(w.block_bytes), bytearray(a.block_bytes)
    convert_block(block, a, mid, w)
    convert_block(mid, w, back, a)
    nan = np.isnan(np.frombuffer(block, np.uint8).view(FP8_NP[fp8]).astype(np.float32))
    got, want = np.frombuffer(bytes(back), np.uint8), np.frombuffer(block, np.uint8)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(FP8_NP[fp8]).astype(np.float32)).all()  # a NaN stays one


def _toward_zero(x: np.ndarray, fp8: str) -> np.ndarray:
    """The reference: float64 arithmetic, fp8's step at each magnitude, saturating."""
    info = ml_dtypes.finfo(FP8_NP[fp8])
    a = np.abs(x).astype(np.float64)
    exp = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1))), np.log2(info.smallest_normal))
    step = 2.0 ** (exp - info.nmant)
    return np.copysign(np.minimum(np.floor(a / step) * step, float(info.max)), x)


@pytest.mark.parametrize("fp8", list(FP8))
def test_narrowing_to_fp8_stores_what_the_receivers_engine_would(fp8: str):
    """A CPU receiver truncates toward zero, as vLLM's CPU kernels store fp8 KV (checked on
    real engines: scripts/cpu_kv_layout.py); a GPU one rounds to nearest even like torch.
    Both saturate finite values beyond fp8's range."""
    a, cpu = geo("float32", LAYOUT_CPU_PACKED), geo(fp8, LAYOUT_CPU_PACKED)
    gpu = cpu.model_copy(update={"device": "cuda"})
    rng = np.random.default_rng(3)
    x = rng.standard_normal(a.block_bytes // 4, np.float32) * rng.choice([1e-6, 1, 40, 1e5],
                                                                       a.block_bytes // 4)  # fmt: skip
    x = x.astype(np.float32)
    got = {}
    for g in (cpu, gpu):
        out = bytearray(g.block_bytes)
        convert_block(x.tobytes(), a, out, g)
        got[g.device] = np.frombuffer(bytes(out), np.uint8).view(FP8_NP[fp8]).astype(np.float64)
    assert np.array_equal(got["cpu"], _toward_zero(x, fp8))
    top = float(ml_dtypes.finfo(FP8_NP[fp8]).max)
    want = torch.from_numpy(np.clip(x, -top, top)).to(FP8[fp8]).double().numpy()
    assert np.array_equal(got["cuda"], want)


def test_narrowing_rounds_like_torch():
    a, b = geo("float32", LAYOUT_CPU_PACKED), geo("bfloat16", LAYOUT_CPU_PACKED)
    x = np.random.default_rng(2).standard_normal(a.block_bytes // 4, np.float32) * 1e3
    x[:4] = [np.inf, -np.inf, np.nan, 3.4e38]
    out = bytearray(b.block_bytes)
    convert_block(x.tobytes(), a, out, b)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = np.frombuffer(bytes(out), np.uint16)
    assert np.array_equal(got[3:], want[3:]) and got[2] & 0x7F80 == 0x7F80 and got[2] & 0x7F


def test_layouts_keep_k_and_v_where_each_layout_says():
    """vLLM's CPU layout holds, per layer and KV head, K transposed [D, B] then V [B, D]
    (read off real engines: kv_convert's docstring); K/V-split holds [2, B, H, D]."""
    packed, split = geo("float32", LAYOUT_CPU_PACKED), geo("float32", LAYOUT_KV_SPLIT)
    L, H, B, D = 2, 2, 32, 128  # noqa: N806
    t = np.arange(L * H * 2 * B * D, dtype=np.float32).reshape(L, H, 2 * B * D)
    out = bytearray(split.block_bytes)
    convert_block(t.tobytes(), packed, out, split)
    s = np.frombuffer(bytes(out), np.float32).reshape(L, 2, B, H, D)
    k_t, v = t[1, 1, : B * D].reshape(D, B), t[1, 1, B * D :].reshape(B, D)  # layer 1, head 1
    assert np.array_equal(s[1, 0, 5, 1], k_t[:, 5])  # K of token 5
    assert np.array_equal(s[1, 1, 5, 1], v[5])  # its V


def test_other_models_or_block_sizes_are_not_converted():
    with pytest.raises(ConfigError, match="block_size differs"):
        convert_block(b"", BASE, bytearray(), BASE.model_copy(update={"block_size": 64}))
    with pytest.raises(ConfigError, match="num_layers differs"):
        convert_block(b"", BASE, bytearray(), BASE.model_copy(update={"num_layers": 3}))
    with pytest.raises(ConfigError, match="source of 3 bytes"):
        convert_block(b"abc", BASE, bytearray(BASE.block_bytes), BASE)
