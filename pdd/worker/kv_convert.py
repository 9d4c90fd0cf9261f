"""Conversion of one KV block between two geometries of the same model (dtype and layout).

MainDecode's landing runs it on every block P sent in another dtype or layout
(``pdd.main_decode.landing``: the chunks land in a scratch buffer, the whole verified block is
converted into its DRC slot). Pure numpy over byte buffers, no torch.

One block = every layer's K and V of ``block_size`` tokens, layer after layer. Per layer:

    cpu_packed_kv   [H, B, 2D]     K = [..., :D], V = [..., D:]   (vLLM's CPU cache)
    kv_split        [2, B, H, D]   K bytes, then V bytes           (FlashAttention split)

dtypes: float32 and bfloat16. bfloat16 -> float32 is exact (the 16 bits go on top);
float32 -> bfloat16 rounds to nearest even like torch (NaN keeps its top bits), so every
widening conversion round-trips bit-exactly, in any layout pair. Identity fields, block size
and KV heads must match (ConfigError otherwise): block-size and head regrouping are not here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdd.errors import ConfigError
from pdd.kv_geometry import CONVERSIONS, LAYOUT_CPU_PACKED, KvGeometry, identity_conflict

DTYPES = tuple(sorted(CONVERSIONS["kv_dtype"]))
LAYOUTS = tuple(sorted(CONVERSIONS["layout"]))


def convert_block(src: Any, src_geom: KvGeometry, dst: Any, dst_geom: KvGeometry) -> None:
    """Write the block in ``src`` (``src_geom``) into ``dst`` (``dst_geom``). Raises
    ConfigError for a pair it cannot convert or buffers of the wrong size."""
    _check(src_geom, dst_geom)
    kv = _to_canonical(_as_array(src, src_geom), src_geom)  # float32 [L, 2, B, H, D]
    out = _from_canonical(kv, dst_geom)
    view = np.frombuffer(memoryview(dst).cast("B"), dtype=np.uint8)
    if view.nbytes != dst_geom.block_bytes:
        raise ConfigError(f"destination of {view.nbytes} bytes, block is {dst_geom.block_bytes}")
    view[:] = out.view(np.uint8).reshape(-1)


def _check(a: KvGeometry, b: KvGeometry) -> None:
    field = identity_conflict(a, b)
    for name in ("block_size", "kv_head_start", "kv_head_end"):
        if field is None and getattr(a, name) != getattr(b, name):
            field = name
    if field is not None:
        raise ConfigError(f"cannot convert KV: {field} differs ({getattr(a, field)} vs "
                          f"{getattr(b, field)})")  # fmt: skip
    for g in (a, b):
        if g.kv_dtype not in DTYPES or g.layout not in LAYOUTS:
            raise ConfigError(f"cannot convert KV of dtype {g.kv_dtype}, layout {g.layout}")


def _as_array(buf: Any, g: KvGeometry) -> np.ndarray:
    raw = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    if raw.nbytes != g.block_bytes:
        raise ConfigError(f"source of {raw.nbytes} bytes, block is {g.block_bytes}")
    if g.kv_dtype == "float32":
        return raw.view(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # exact widening


def _shape(g: KvGeometry) -> tuple[int, ...]:
    L, H, B, D = g.num_layers, g.heads_held, g.block_size, g.head_dim  # noqa: N806
    return (L, H, B, 2, D) if g.layout == LAYOUT_CPU_PACKED else (L, 2, B, H, D)


def _to_canonical(flat: np.ndarray, g: KvGeometry) -> np.ndarray:
    t = flat.reshape(_shape(g))
    if g.layout == LAYOUT_CPU_PACKED:  # [L, H, B, 2, D] -> [L, 2, B, H, D]
        t = t.transpose(0, 3, 2, 1, 4)
    return t


def _from_canonical(kv: np.ndarray, g: KvGeometry) -> np.ndarray:
    t = kv.transpose(0, 3, 2, 1, 4) if g.layout == LAYOUT_CPU_PACKED else kv
    t = np.ascontiguousarray(t, dtype=np.float32)
    if g.kv_dtype == "float32":
        return t
    return _to_bf16_bits(t)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even; a NaN keeps its top 16 bits (quiet
    bit set when they would read as infinity)."""
    bits = x.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7F800000) == 0x7F800000
    nan &= (bits & 0x007FFFFF) != 0
    top = (bits >> 16).astype(np.uint16)
    top |= np.where((top & 0x7F) == 0, 0x40, 0).astype(np.uint16)  # a NaN stays a NaN
    return np.where(nan, top, rounded)
