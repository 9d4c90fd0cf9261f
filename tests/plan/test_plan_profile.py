"""Chip profiles: the examples load, the formulas, and errors that name the file and field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdd.errors import ConfigError
from pdd.plan.profile import load_profile, load_profiles
from tests.plan.conftest import PROFILES, ROOT


def test_example_profiles_load_and_b_is_the_dearer_decode_chip(profiles) -> None:
    a, b = profiles["A"], profiles["B"]
    assert 1.2 <= b.price_per_hour / a.price_per_hour <= 1.3  # the report's premium
    assert b.decode_step_s(16, 16 * 65536) < a.decode_step_s(16, 16 * 65536)
    assert b.memory.kv_capacity_tokens > a.memory.kv_capacity_tokens
    assert a.assumptions and b.assumptions


def test_prefill_formula_counts_chunks_tokens_and_attention(profiles) -> None:
    a = profiles["A"]
    p = a.prefill
    assert a.prefill_s(8192, 0) == pytest.approx(
        p.chunk_overhead_s + 8192 * p.per_token_s + 8192 * 4096 * p.per_token_context_s
    )
    # one more token past a chunk boundary pays a whole forward's overhead (a tail chunk)
    assert a.prefill_s(8193, 0) - a.prefill_s(8192, 0) > p.chunk_overhead_s
    assert a.prefill_s(0, 1000) == p.chunk_overhead_s
    assert a.prefill_s(100, 60000) > a.prefill_s(100, 0)  # attention over the cached prefix


def test_a_forward_under_the_knee_costs_the_knee() -> None:
    moe = load_profile(ROOT / "configs/profiles/chip-a-moe.yaml")
    p = moe.prefill
    assert p.min_forward_tokens > 0 and p.chunk_tokens > p.min_forward_tokens
    # a one-token tail chunk costs a whole forward at the knee: the weights are read anyway
    tail = moe.prefill_s(p.chunk_tokens + 1, 0) - moe.prefill_s(p.chunk_tokens, 0)
    assert tail >= p.chunk_overhead_s + p.min_forward_tokens * p.per_token_s
    assert moe.prefill_s(1, 0) == pytest.approx(moe.prefill_s(p.min_forward_tokens, 0), rel=0.2)
    # at or above the knee every token is paid once, as without one
    flat = moe.model_copy(update={"prefill": p.model_copy(update={"min_forward_tokens": 0})})
    assert moe.prefill_s(2 * p.chunk_tokens, 500) == flat.prefill_s(2 * p.chunk_tokens, 500)
    assert moe.prefill_s(0, 1000) == pytest.approx(
        p.chunk_overhead_s + p.min_forward_tokens * p.per_token_s
    )


def test_a_static_shape_engine_pays_for_a_tail_chunks_whole_bucket(profiles) -> None:
    """chip-a-static.yaml is chip A (it extends chip-a.yaml) with its forwards padded to powers
    of two: a tail chunk just past a bucket costs the next bucket's GEMMs, attention does not
    change, and a tail that fills its bucket costs what it does on chip A."""
    a, static = profiles["A"], load_profile(ROOT / "configs/profiles/chip-a-static.yaml")
    assert static.model_dump(exclude={"description", "assumptions", "prefill"}) == a.model_dump(
        exclude={"description", "assumptions", "prefill"}
    )
    p, chunk = static.prefill, static.prefill.chunk_tokens
    assert p.forward_buckets[-1] == chunk and p.shaped(1025) == 2048 and p.shaped(2048) == 2048
    padded = static.prefill_s(chunk + 1025, 30000) - a.prefill_s(chunk + 1025, 30000)
    assert padded == pytest.approx((2048 - 1025) * p.per_token_s)
    assert static.prefill_s(chunk + 2048, 30000) == pytest.approx(a.prefill_s(chunk + 2048, 30000))
    assert static.prefill_s(2 * chunk, 0) == pytest.approx(a.prefill_s(2 * chunk, 0))


def test_bad_buckets_and_an_extends_cycle_are_refused(tmp_path: Path) -> None:
    base = {"extends": str(ROOT / "configs/profiles/chip-a.yaml")}
    with pytest.raises(ConfigError, match="prefill.*forward_buckets must be positive"):
        load_profile(_write(tmp_path, {**base, "prefill": {"forward_buckets": [64, 32, 8192]}}))
    with pytest.raises(ConfigError, match="the last at least chunk_tokens"):
        load_profile(_write(tmp_path, {**base, "prefill": {"forward_buckets": [16, 4096]}}))
    (tmp_path / "x.yaml").write_text("extends: y.yaml\n")
    (tmp_path / "y.yaml").write_text("extends: x.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_profile(tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match="absent.yaml: cannot read"):
        load_profile(_write(tmp_path, {"extends": "absent.yaml"}))


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "chip.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_missing_field_names_the_field_and_the_file(tmp_path: Path) -> None:
    data = yaml.safe_load(PROFILES[0].read_text())
    del data["decode"]["per_context_token_s"]
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert str(path) in str(err.value)
    assert "missing field 'decode.per_context_token_s'" in str(err.value)


def test_bad_value_and_unknown_field_are_named(tmp_path: Path) -> None:
    data = yaml.safe_load(PROFILES[0].read_text())
    data["memory"]["max_batch"] = 0
    data["tflops"] = 5
    with pytest.raises(ConfigError) as err:
        load_profile(_write(tmp_path, data))
    assert "memory.max_batch" in str(err.value) and "tflops" in str(err.value)


def test_unreadable_or_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "absent.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_profile(tmp_path / "list.yaml")


def test_two_profiles_of_one_chip_are_refused() -> None:
    with pytest.raises(ConfigError, match="given twice"):
        load_profiles([PROFILES[0], PROFILES[0]])
