"""Conversion of KV blocks between two geometries of the same model: dtype, layout, block size.

MainDecode's landing runs it on every block P sent in another dtype, layout or block size
(``pdd.main_decode.landing``: a sender block's chunks land in a scratch buffer; once it is
verified, ``Regroup`` copies its tokens into the receiver blocks it overlaps and hands back a
receiver block every token of which arrived, in the receiver's geometry). Pure numpy over
byte buffers, no torch.

One block = every layer's K and V of ``block_size`` (B) tokens, layer after layer. Per layer:

    cpu_packed_kv   per KV head: K transposed [D, B], then V [B, D]   (vLLM 0.32's CPU cache
                    with its vec attention kernels: measured, see below)
    kv_split        [2, B, H, D]   K bytes, then V bytes           (FlashAttention split)

The CPU layout was read off real engines (2026-12-02, float32, the default model): the same
128-token prompt exported at block 32 and at block 64 gives the same values, and block 64's
rows are block 32's regrouped exactly this way (per head, each of the D rows of K^T holds the
block's tokens; V holds a row of D per token). vLLM's AMX kernels (bfloat16 where AMX tiles
exist) keep another interior (``LAYOUT_CPU_AMX``, not this one: its bytes do not correlate with
float32's at the same positions) and are never converted. bfloat16 with the vec kernels (CPUs
without AMX) is assumed to keep the float32 interior: not verified here.

dtypes: float32, bfloat16 and vLLM's fp8 KV caches (fp8_e4m3 = torch's float8_e4m3fn,
fp8_e5m2; values stored at scale 1.0, vLLM's default). bfloat16 -> float32 is exact (the 16
bits go on top) and so is fp8 -> anything wider; float32 -> bfloat16 rounds to nearest even
like torch (NaN keeps its top bits). Into fp8 a receiver stores what its own engine would
have: vLLM's CPU kernels truncate toward zero (read off real engines: float32 KV narrowed
this way equals an fp8 engine's own layer-0 KV byte for byte, ``scripts/cpu_kv_layout.py
fp8_e4m3``); on other devices it rounds to nearest even (CUDA's ``__NV_SATFINITE``
conversion vLLM uses; not verified here). Finite values beyond fp8's range saturate at its
largest finite value (assumed for the CPU kernels: no KV value of the default model comes near
fp8_e4m3's 448). So every
widening conversion round-trips bit-exactly, in any layout pair. Everything passes through one
canonical float32 form [L, 2, B, H, D], exact for every dtype here. Identity fields and the KV
heads held must match (ConfigError otherwise); a slot always holds every head, whatever the
engines' tensor-parallel degrees (pdd.engine.connector_worker).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np

from pdd.errors import ConfigError, TransferError
from pdd.kv_geometry import CONVERSIONS, LAYOUT_CPU_PACKED, KvGeometry, identity_conflict

DTYPES = tuple(sorted(CONVERSIONS["kv_dtype"]))
FP8 = {"fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
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
    if g.kv_dtype in FP8:
        return raw.view(FP8[g.kv_dtype]).astype(np.float32)  # exact widening
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # exact widening


def _to_canonical(flat: np.ndarray, g: KvGeometry) -> np.ndarray:
    """One block's float32 values in ``g``'s layout -> [L, 2, B, H, D]."""
    L, H, B, D = g.num_layers, g.heads_held, g.block_size, g.head_dim  # noqa: N806
    if g.layout != LAYOUT_CPU_PACKED:
        return flat.reshape(L, 2, B, H, D)
    per_head = flat.reshape(L, H, 2 * B * D)
    k = per_head[:, :, : B * D].reshape(L, H, D, B).transpose(0, 3, 1, 2)  # -> [L, B, H, D]
    v = per_head[:, :, B * D :].reshape(L, H, B, D).transpose(0, 2, 1, 3)
    return np.stack((k, v), axis=1)


def _from_canonical(kv: np.ndarray, g: KvGeometry) -> np.ndarray:
    """[L, 2, B, H, D] float32 -> one block's items in ``g`` (float32, bfloat16 or fp8 bits)."""
    if g.layout == LAYOUT_CPU_PACKED:
        L, _, B, H, D = kv.shape  # noqa: N806
        k = kv[:, 0].transpose(0, 2, 3, 1).reshape(L, H, D * B)  # per head K^T [D, B]
        v = kv[:, 1].transpose(0, 2, 1, 3).reshape(L, H, B * D)  # per head V [B, D]
        kv = np.concatenate((k, v), axis=2)
    t = np.ascontiguousarray(kv, dtype=np.float32)
    if g.kv_dtype == "float32":
        return t
    if g.kv_dtype in FP8:
        return _to_fp8(t, FP8[g.kv_dtype], toward_zero=g.device == "cpu")
    return _to_bf16_bits(t)


def _to_fp8(x: np.ndarray, fp8: np.dtype, toward_zero: bool) -> np.ndarray:
    """float32 -> fp8, a finite value beyond its range saturating at its largest finite one
    (an infinity or a NaN stays one where fp8 has it): truncated toward zero (vLLM's CPU
    kernels) or rounded to nearest even."""
    info = ml_dtypes.finfo(fp8)
    top = np.float32(info.max)
    special = ~np.isfinite(x)
    if not toward_zero:
        return np.where(special, x, np.clip(x, -top, top)).astype(fp8)
    a = np.abs(x)
    drop = np.uint32((1 << (23 - info.nmant)) - 1)
    normal = (a.view(np.uint32) & ~drop).view(np.float32)  # the mantissa cut to fp8's bits
    step = np.float32(float(info.smallest_normal) * 2.0**-info.nmant)  # fp8's subnormal step
    cut = np.where(a < np.float32(info.smallest_normal), np.floor(a / step) * step, normal)
    cut = np.where(special, x, np.copysign(np.minimum(cut, top), x))
    return cut.astype(fp8)  # exact: every value is one of fp8's


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


class Regroup:
    """Receiver blocks (``dst``) assembled from sender blocks (``src``): another block size,
    dtype or layout.

    Sender block i holds tokens [i * Bs, (i + 1) * Bs), receiver block j tokens [j * Bd,
    (j + 1) * Bd). ``put(i, data, into)`` copies the tokens of i that fall in each j of
    ``into`` (canonical float32: exact for both dtypes); once every sender block j overlaps
    came it returns j's bytes in ``dst``'s geometry and forgets it. A receiver block the sender's whole blocks do
    not cover never completes: the receiver computes its tokens. Not thread-safe: the
    receiver's lock guards it.
    """

    def __init__(self, src: KvGeometry, dst: KvGeometry) -> None:
        _check(src.model_copy(update={"block_size": dst.block_size}), dst)
        self.src, self.dst = src, dst
        self._parts: dict[int, np.ndarray] = {}  # receiver block -> its tokens so far
        self._have: dict[int, set[int]] = {}  # receiver block -> sender blocks copied in

    def targets(self, i: int) -> range:
        """The receiver blocks sender block ``i`` overlaps."""
        bs, bd = self.src.block_size, self.dst.block_size
        return range(i * bs // bd, ((i + 1) * bs - 1) // bd + 1)

    def put(self, i: int, data: Any, into: Iterable[int]) -> dict[int, bytes]:
        """Copy sender block ``i``'s tokens into the receiver blocks ``into`` (of those it
        overlaps); the bytes of each that became complete. ``data`` is converted once."""
        bs, bd = self.src.block_size, self.dst.block_size
        tokens = _to_canonical(_as_array(data, self.src), self.src)
        done: dict[int, bytes] = {}
        for j in into:
            lo, hi = max(i * bs, j * bd), min((i + 1) * bs, (j + 1) * bd)
            if lo >= hi:
                continue
            part = self._parts.get(j)
            if part is None:
                g = self.dst
                shape = (g.num_layers, 2, bd, g.heads_held, g.head_dim)
                part = self._parts[j] = np.empty(shape, np.float32)
                self._have[j] = set()
            part[:, :, lo - j * bd : hi - j * bd] = tokens[:, :, lo - i * bs : hi - i * bs]
            self._have[j].add(i)
            first, last = j * bd // bs, ((j + 1) * bd - 1) // bs
            if len(self._have[j]) == last - first + 1:
                del self._have[j]
                done[j] = _from_canonical(self._parts.pop(j), self.dst).tobytes()
        return done


class Scratch:
    """A receiver's sender blocks in another geometry, assembled chunk by chunk (a scratch
    buffer each, and the byte ranges verified so far) until ``regroup`` takes them. Not
    thread-safe: the receiver's landing lock guards it."""

    def __init__(self, regroup: Regroup) -> None:
        self.regroup = regroup
        self.bufs: dict[int, bytearray] = {}  # sender block -> its bytes
        self._parts: dict[int, dict[int, int]] = {}  # sender block -> verified {offset: n}

    def view(self, block: int, offset: int, nbytes: int) -> memoryview:
        """Where bytes [offset, offset + nbytes) of sender block ``block`` land."""
        buf = self.bufs.get(block)
        if buf is None:
            buf = self.bufs[block] = bytearray(self.regroup.src.block_bytes)
        return memoryview(buf)[offset : offset + nbytes]

    def verify(self, block: int, offset: int, nbytes: int) -> bool:
        """Record a verified chunk; True once every byte of ``block`` is (and it is here)."""
        if block not in self.bufs:
            return False  # a throw-away buffer, or a duplicate
        parts = self._parts.setdefault(block, {})
        parts[offset] = nbytes
        return covers(parts, self.regroup.src.block_bytes)

    def pop(self, block: int) -> bytearray:
        """Sender block ``block``'s bytes, forgotten here."""
        self._parts.pop(block, None)
        return self.bufs.pop(block)

    def clear(self) -> None:
        self.bufs.clear()
        self._parts.clear()


def scratch_for(
    held: Scratch | None, src: KvGeometry, own: KvGeometry | None, kv_id: str
) -> Scratch:
    """A landing's scratch for KV sent in ``src`` (``held``: the one it has, else a new one
    into ``own``). TransferError, refusing the chunk, for a pair ``Regroup`` cannot convert or
    chunks of one landing in two geometries."""
    if held is not None:
        if held.regroup.src != src:
            raise TransferError(f"KV of {kv_id!r}: chunks in two KV geometries")
        return held
    assert own is not None, "a converted chunk passed the check of a known geometry"
    try:
        return Scratch(Regroup(src, own))
    except ConfigError as exc:
        raise TransferError(f"KV of {kv_id!r}: {exc.message}") from exc


def covers(parts: dict[int, int], size: int) -> bool:
    """Whether the verified byte ranges ``{offset: nbytes}`` tile ``[0, size)`` exactly."""
    end = 0
    for offset in sorted(parts):
        if offset != end:
            return False
        end += parts[offset]
    return end == size
