"""The KV geometry of one worker: what its paged KV cache holds and how, known to everyone.

Each worker derives a ``KvGeometry`` from its engine (``pdd.engine.engine.Engine.kv_geometry``)
and reports it in Health, in fleet registration and so in ``pdd status``. The router compares
geometries before it pairs a sender with a receiver; a receiver compares every inbound chunk's
header with its own geometry before the bytes land (``pdd.worker.inbound.KvWireCheck``).

Fields split in two (``IDENTITY`` / ``LANDING``):

    identity  fingerprint, num_layers, total_kv_heads, head_dim: KV of workers that differ here
              can never be converted (another model): the router never pairs them and does
              not admit a worker whose identity differs from the fleet's model.
    landing   kv_dtype, block_size, layout, kv_head_start/kv_head_end: KV can in principle be
              converted; a pair is routed only when the receiver converts every landing field
              that differs, between those two values (``converts``, ``convertible``:
              MainDecode and RelayDecode each convert the dtype and the layout between the
              values in ``CONVERSIONS``, and any pair of block sizes, as long as both layouts
              are ones it knows). Anything else would be refused chunk by chunk and
              recomputed.

The model fingerprint comes from the model folder, not its name (``model_fingerprint``): the
config (without its dtype), every tensor's name and shape from the safetensors headers, and a
few values of every tensor rounded to bfloat16, so the same weights saved in float32 and in
bfloat16 match while another model, another fine-tune or another layer count do not. Reading
it costs a few hundred small reads (milliseconds), no torch. Lives in the wire layer: the
router, the shell and the transports all read it.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from pdd.errors import ModelError
from pdd.protocol import Role

if TYPE_CHECKING:
    from pdd.proto import worker_pb2

# Layouts of one block on the wire (``pdd.engine.kv_copy``, ``pdd.worker.kv_convert``): vLLM's
# CPU cache with its vec attention kernels (float32 everywhere; bfloat16 without AMX) holds per
# KV head K transposed [D, B] then V [B, D]; with its AMX kernels (bfloat16 where AMX tiles
# exist) an interior of its own, never converted; a K/V-split cache gives K then V.
LAYOUT_CPU_PACKED = "cpu_packed_kv"
LAYOUT_CPU_AMX = "cpu_amx"
LAYOUT_KV_SPLIT = "kv_split"
# A GPU engine's layout as its worker process sees it: the connector picks block-first or
# K/V-split inside the engine core (kv_copy.detect_block_dim) and does not report it yet.
LAYOUT_GPU_PAGED = "gpu_paged"

IDENTITY = ("fingerprint", "num_layers", "total_kv_heads", "head_dim")
LANDING = ("kv_dtype", "block_size", "layout", "kv_head_start", "kv_head_end")
# The values between which a receiver converts the dtype and the layout (pdd.worker.kv_convert);
# block sizes convert between any two (``convertible``).
CONVERSIONS: dict[str, frozenset[str]] = {
    "kv_dtype": frozenset({"float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"}),
    "layout": frozenset({LAYOUT_CPU_PACKED, LAYOUT_KV_SPLIT}),
}
# What each receiving role converts on landing (the rest of LANDING must match).
RECEIVER_CONVERTS: dict[Role, frozenset[str]] = {
    Role.MAIN_DECODE: frozenset({"kv_dtype", "layout", "block_size"}),
    Role.RELAY_DECODE: frozenset({"kv_dtype", "layout", "block_size"}),
}

# Bytes per KV item; fp8_*: vLLM's fp8 KV cache (``engine.kv_cache_dtype``), torch's
# float8_e4m3fn / float8_e5m2 at vLLM's default scale of 1.0; fp8_*_scaled: the same of a
# quantized checkpoint, whose KV scales pdd does not know (so it never converts them).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1,
               "fp8_e4m3_scaled": 1, "fp8_e5m2_scaled": 1}  # fmt: skip
_SAMPLE = 8  # values of each tensor that enter the fingerprint (at its start and middle)


class KvGeometry(BaseModel):
    """What one worker's paged KV cache holds (one KV block = every layer's K and V)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fingerprint: str = Field(..., min_length=1, max_length=64, description="model_fingerprint")
    num_layers: int = Field(..., gt=0, description="Attention layers with a KV cache.")
    total_kv_heads: int = Field(..., gt=0, description="KV heads of the model.")
    kv_head_start: int = Field(0, ge=0, description="First KV head this worker holds.")
    kv_head_end: int = Field(..., gt=0, description="One past the last KV head it holds.")
    head_dim: int = Field(..., gt=0)
    block_size: int = Field(..., gt=0, description="Tokens per KV block.")
    kv_dtype: str = Field(..., min_length=1, max_length=16, description="KV-cache dtype.")
    device: str = Field("cpu", min_length=1, max_length=32, description="cpu | cuda | ...")
    layout: str = Field(LAYOUT_CPU_PACKED, min_length=1, max_length=16, description="Paged layout.")
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="The engine's ranks, each holding its share of the heads; its slots and "
        "the wire hold every head above whatever it is (so it never has to match a peer's).",
    )

    @property
    def heads_held(self) -> int:
        return self.kv_head_end - self.kv_head_start

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.kv_dtype, 0)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Logical shape of one block on the wire: (layers, heads held, tokens, 2 x head_dim)."""
        return (self.num_layers, self.heads_held, self.block_size, 2 * self.head_dim)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.dtype_bytes

    def summary(self) -> str:
        """One line for logs and ``pdd status``."""
        return (
            f"{self.fingerprint[:12]} L{self.num_layers} kvh{self.kv_head_start}-"
            f"{self.kv_head_end}/{self.total_kv_heads} d{self.head_dim} B{self.block_size} "
            f"{self.kv_dtype} {self.layout} {self.device}"
            + (f" tp{self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else "")
        )

    # --- proto (HealthResponse.geometry) --------------------------------------------------

    def to_proto(self) -> worker_pb2.KvGeometry:
        from pdd.proto import worker_pb2

        return worker_pb2.KvGeometry(**self.model_dump())

    @classmethod
    def from_proto(cls, msg: worker_pb2.KvGeometry) -> KvGeometry | None:
        """None when the message is unset (a worker that reports no geometry)."""
        if not msg.fingerprint:
            return None
        fields = {name: getattr(msg, name) for name in cls.model_fields}
        fields["tensor_parallel_size"] = fields["tensor_parallel_size"] or 1  # an older worker
        return cls(**fields)


def _differs(a: KvGeometry, b: KvGeometry, fields: tuple[str, ...]) -> str | None:
    for name in fields:
        if getattr(a, name) != getattr(b, name):
            return name
    return None


def identity_conflict(a: KvGeometry, b: KvGeometry) -> str | None:
    """The first identity field that differs (KV that can never be converted), else None."""
    return _differs(a, b, IDENTITY)


def pair_conflict(sender: KvGeometry, receiver: KvGeometry,
                  converts: frozenset[str] = frozenset()) -> str | None:  # fmt: skip
    """The first field that keeps ``sender``'s KV from landing on ``receiver``: an identity
    field, or a landing field that differs and the receiver does not convert (not in
    ``converts``, or not between these two values). None: they can pair."""
    field = identity_conflict(sender, receiver)
    if field is not None:
        return field
    differs = [n for n in LANDING if getattr(sender, n) != getattr(receiver, n)]
    for name in differs:
        a, b = getattr(sender, name), getattr(receiver, name)
        if name not in converts or not convertible(name, a, b):
            return name
    if differs and not interiors_known(sender.layout, receiver.layout):
        return "layout"
    return None


def interiors_known(*layouts: str) -> bool:
    """Whether pdd knows these block interiors: converting anything (dtype, block size)
    needs both sides' known, even when the layouts are equal."""
    return set(layouts) <= CONVERSIONS["layout"]


def convertible(field: str, a: object, b: object) -> bool:
    """Whether a receiver that converts ``field`` lands KV whose ``field`` is ``a`` as ``b``."""
    if field == "block_size":
        return isinstance(a, int) and isinstance(b, int) and a > 0 and b > 0
    return {a, b} <= CONVERSIONS.get(field, frozenset())


def describe_conflict(field: str, a_id: str, a: KvGeometry, b_id: str, b: KvGeometry) -> str:
    """``field`` differs between worker ``a_id`` and ``b_id``: one readable sentence."""
    return (
        f"workers {a_id} and {b_id} cannot exchange KV: {field} differs "
        f"({a_id}: {getattr(a, field)}, {b_id}: {getattr(b, field)})"
    )


# --- the model fingerprint ------------------------------------------------------------------

# config.json keys that say how the weights are stored, not what they are.
_STORAGE_KEYS = frozenset({"dtype", "torch_dtype", "_model_name_or_path", "transformers_version"})


def model_fingerprint(folder: Path | str) -> str:
    """A 32-hex-digit fingerprint of a Hugging Face model folder (see the module doc).

    Raises ModelError when the folder has no readable config.json or safetensors file.
    """
    folder = Path(folder)
    h = hashlib.sha256()
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    kept = {k: v for k, v in config.items() if k not in _STORAGE_KEYS}
    h.update(json.dumps(kept, sort_keys=True).encode())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"model folder {folder} has no .safetensors file")
    tensors: dict[str, tuple[Path, int, dict]] = {}
    for path in files:
        base, header = _safetensors_header(path)
        for name, info in header.items():
            if name != "__metadata__":
                tensors[name] = (path, base, info)
    for name in sorted(tensors):
        path, base, info = tensors[name]
        h.update(f"{name}:{list(info['shape'])};".encode())
        h.update(_sample_bf16(path, base, info))
    return h.hexdigest()[:32]


def _safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, the header's JSON) of one safetensors file."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ModelError(f"{path}: safetensors header of {size} bytes is not plausible")
            return 8 + size, json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelError(f"cannot read the safetensors header of {path}: {exc}") from exc


def _sample_bf16(path: Path, base: int, info: dict) -> bytes:
    """Up to ``_SAMPLE`` values at the start and at the middle of one tensor, as bfloat16 bits
    (float32 rounded to nearest even, the way torch converts), so float32 and bfloat16 copies
    of the same weights give the same bytes. Other dtypes enter as their raw bytes."""
    start, end = info["data_offsets"]
    dtype = info["dtype"]
    width = {"F32": 4, "BF16": 2, "F16": 2}.get(dtype)
    if width is None:
        return dtype.encode()
    count = (end - start) // width
    out = bytearray()
    with path.open("rb") as f:
        for first in sorted({0, count // 2}):
            n = min(_SAMPLE, count - first)
            f.seek(base + start + first * width)
            raw = f.read(n * width)
            out += _to_bf16(raw, dtype)
    return bytes(out)


def _to_bf16(raw: bytes, dtype: str) -> bytes:
    if dtype == "BF16":
        return raw
    values = struct.unpack(f"<{len(raw) // 2}e", raw) if dtype == "F16" else None
    if values is not None:  # float16: widen exactly to float32 first
        raw = struct.pack(f"<{len(values)}f", *values)
    out = bytearray()
    for (bits,) in struct.iter_unpack("<I", raw):
        if (bits & 0x7F800000) == 0x7F800000 and bits & 0x007FFFFF:  # NaN stays a NaN
            out += struct.pack("<H", (bits >> 16) | 0x40)
            continue
        rounding = 0x7FFF + ((bits >> 16) & 1)
        out += struct.pack("<H", ((bits + rounding) >> 16) & 0xFFFF)
    return bytes(out)


def folder_geometry(folder: Path | str, block_size: int, kv_dtype: str, device: str = "cpu",
                    layout: str = LAYOUT_CPU_PACKED) -> KvGeometry:  # fmt: skip
    """The geometry of a model folder served at one engine configuration (every KV head, as
    any worker's slots hold; tensor parallel size 1). Raises ModelError for an unreadable
    folder."""
    folder = Path(folder)
    try:
        hf = json.loads((folder / "config.json").read_text())
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        kv_heads = hf.get("num_key_value_heads") or heads
        layers = hf["num_hidden_layers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"cannot read the KV shape from {folder / 'config.json'}: {exc}") from exc
    return KvGeometry(
        fingerprint=model_fingerprint(folder),
        num_layers=layers,
        total_kv_heads=kv_heads,
        kv_head_end=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        kv_dtype=kv_dtype,
        device=device,
        layout=layout,
    )
