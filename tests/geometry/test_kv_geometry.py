"""pdd.kv_geometry: the model fingerprint (the same weights in float32 and bfloat16 match;
another value, another layer count or another config do not), the pair and identity checks,
and the proto round trip. Model folders are written here (tiny safetensors files)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from pdd.errors import ModelError
from pdd.kv_geometry import (
    LAYOUT_CPU_AMX,
    RECEIVER_CONVERTS,
    KvGeometry,
    describe_conflict,
    folder_geometry,
    identity_conflict,
    model_fingerprint,
    pair_conflict,
)
from pdd.protocol import Role

CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
          "num_hidden_layers": 2, "model_type": "llama"}  # fmt: skip
# float32 values whose bfloat16 rounding (nearest even) is what the bf16 file holds
VALUES = [1.0, -2.5, 3.14159, 1e-3, 0.333333, 65504.0, -0.0, 7.75]


def _bf16_bits(x: float) -> int:
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def write_model(folder: Path, dtype: str = "F32", values=VALUES, config=None, names=("a", "b")):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config or CONFIG, torch_dtype="float32" if dtype == "F32" else "bfloat16")
    (folder / "config.json").write_text(json.dumps(cfg))
    if dtype == "F32":
        raw = struct.pack(f"<{len(values)}f", *values)
    else:
        raw = struct.pack(f"<{len(values)}H", *(_bf16_bits(v) for v in values))
    header, data, offset = {}, b"", 0
    for name in names:
        header[name] = {"dtype": dtype, "shape": [len(values)],
                        "data_offsets": [offset, offset + len(raw)]}  # fmt: skip
        data += raw
        offset += len(raw)
    blob = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return folder


def geometry(**kw) -> KvGeometry:
    base = dict(fingerprint="f" * 32, num_layers=30, total_kv_heads=3, kv_head_end=3,
                head_dim=64, block_size=32, kv_dtype="float32")  # fmt: skip
    return KvGeometry(**{**base, **kw})


def test_the_same_weights_in_float32_and_bfloat16_have_one_fingerprint(tmp_path):
    f32 = model_fingerprint(write_model(tmp_path / "f32", "F32"))
    bf16 = model_fingerprint(write_model(tmp_path / "bf16", "BF16"))
    assert f32 == bf16 and len(f32) == 32


def test_other_weights_config_or_layers_change_the_fingerprint(tmp_path):
    base = model_fingerprint(write_model(tmp_path / "base"))
    other_value = model_fingerprint(write_model(tmp_path / "v", values=[*VALUES[:-1], 9.0]))
    other_layers = model_fingerprint(
        write_model(tmp_path / "l", config={**CONFIG, "num_hidden_layers": 3})
    )
    other_tensors = model_fingerprint(write_model(tmp_path / "t", names=("a",)))
    assert len({base, other_value, other_layers, other_tensors}) == 4


def test_a_folder_without_weights_is_a_model_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ModelError, match="no .safetensors"):
        model_fingerprint(tmp_path)
    with pytest.raises(ModelError, match="config.json"):
        model_fingerprint(tmp_path / "missing")


def test_folder_geometry_reads_the_kv_shape(tmp_path):
    g = folder_geometry(write_model(tmp_path / "m"), block_size=32, kv_dtype="bfloat16")
    assert (g.num_layers, g.total_kv_heads, g.heads_held, g.head_dim) == (2, 2, 2, 16)
    assert g.block_shape == (2, 2, 32, 32) and g.block_bytes == 2 * 2 * 32 * 32 * 2


def test_identity_fields_never_pair_landing_fields_pair_only_when_converted():
    a = geometry()
    assert pair_conflict(a, geometry()) is None
    for field, value in (("fingerprint", "e" * 32), ("num_layers", 15), ("head_dim", 128),
                         ("total_kv_heads", 6)):  # fmt: skip
        assert identity_conflict(a, geometry(**{field: value})) == field
        assert pair_conflict(a, geometry(**{field: value})) == field
    md, rld = RECEIVER_CONVERTS[Role.MAIN_DECODE], RECEIVER_CONVERTS[Role.RELAY_DECODE]
    for field, value in (("kv_dtype", "bfloat16"), ("block_size", 128), ("layout", "kv_split")):
        other = geometry(**{field: value})
        assert identity_conflict(a, other) is None
        assert pair_conflict(a, other) == field  # a receiver that converts nothing
        for converts in (md, rld):  # MainDecode and RelayDecode convert each
            assert pair_conflict(a, other, converts) is None
            assert pair_conflict(other, a, converts) is None
    # ... between the dtypes and layouts its kernel has, no others; KV heads it never regroups
    assert pair_conflict(a, geometry(kv_dtype="float16"), md) == "kv_dtype"
    assert pair_conflict(a, geometry(layout="gpu_paged"), md) == "layout"
    assert pair_conflict(a, geometry(kv_head_end=2), md) == "kv_head_end"
    # vLLM's AMX block interior is its own: never converted, only copied as it is
    amx = geometry(kv_dtype="bfloat16", layout=LAYOUT_CPU_AMX)
    assert pair_conflict(amx, geometry(kv_dtype="float32"), md) == "layout"
    assert pair_conflict(amx, amx.model_copy(update={"block_size": 128}), md) == "layout"
    assert pair_conflict(amx, amx, md) is None
    msg = describe_conflict("kv_dtype", "p0", a, "md0", geometry(kv_dtype="bfloat16"))
    assert msg == ("workers p0 and md0 cannot exchange KV: kv_dtype differs "
                   "(p0: float32, md0: bfloat16)")  # fmt: skip


def test_proto_round_trip_and_unset():
    from pdd.proto import worker_pb2 as pb

    g = geometry(layout="kv_split", device="cuda", kv_head_start=1, kv_head_end=2)
    assert KvGeometry.from_proto(g.to_proto()) == g
    assert KvGeometry.from_proto(pb.HealthResponse().geometry) is None
    tp3 = geometry(tensor_parallel_size=3)
    assert KvGeometry.from_proto(tp3.to_proto()) == tp3 and tp3.summary().endswith(" tp3")
    older = tp3.to_proto()
    older.ClearField("tensor_parallel_size")  # a worker from before the field: one rank
    assert KvGeometry.from_proto(older).tensor_parallel_size == 1


def test_the_tensor_parallel_degree_never_keeps_two_workers_apart():
    """Every worker's slots hold every KV head, whatever its ranks: nothing to convert."""
    md = RECEIVER_CONVERTS[Role.MAIN_DECODE]
    for a, b in ((1, 3), (3, 1), (2, 4)):
        p, d = geometry(tensor_parallel_size=a), geometry(tensor_parallel_size=b)
        assert pair_conflict(p, d) is None and pair_conflict(p, d, md) is None
        assert identity_conflict(p, d) is None
