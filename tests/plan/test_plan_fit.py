"""`pdd profile`'s fitting (no engine): samples of a known profile give it back; samples that
cannot pin a form down, bad plans and impossible SLAs get errors that say what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdd.errors import ConfigError
from pdd.plan import cli
from pdd.plan.fit import (
    DecodeSample,
    ExtendSample,
    Measured,
    OverheadSample,
    PrefillSample,
    fit_profile,
    fit_serving,
    nnls,
)
from pdd.plan.profile import ChipProfile, load_profile
from pdd.profiler import Plan, write_profile


def _samples(chip: ChipProfile) -> Measured:
    """What pdd profile would measure on a chip that follows ``chip``'s formulas exactly."""
    bs = chip.block_size
    lengths = (1024, 9000, 30000)
    prefill = [PrefillSample(n, 0, chip.prefill_s(n, 0)) for n in lengths]
    prefill += [PrefillSample(bs, n // bs * bs, chip.prefill_s(bs, n // bs * bs)) for n in lengths]
    extend = [ExtendSample(k, chip.extend_s(k)) for k in (1, 16, 64)]
    decode = [DecodeSample(b, b * (n + 16), chip.decode_step_s(b, b * (n + 16)))
              for b in (1, 4, 16) for n in (1024, 30000)]  # fmt: skip
    m = chip.memory
    return Measured(chip.name, chip.model, chip.kv_bytes_per_token, bs, chip.prefill.chunk_tokens,
                    m.kv_capacity_tokens, m.max_batch, m.host_cache_tokens, tuple(prefill),
                    tuple(decode), tuple(extend), ("synthetic",))  # fmt: skip


def test_exact_samples_give_the_profile_back(profiles) -> None:
    a = profiles["A"]
    fitted = fit_profile(_samples(a), a.price_per_hour, "refit")
    for section in ("prefill", "decode", "extend"):
        want, got = getattr(a, section).model_dump(), getattr(fitted, section).model_dump()
        assert got.pop("forward_buckets", []) == want.pop("forward_buckets", []) == []
        assert got == pytest.approx(want, rel=1e-6, abs=1e-15), section
    assert fitted.memory == a.memory and fitted.kv_bytes_per_token == a.kv_bytes_per_token
    assert fitted.assumptions[0] == "synthetic"
    assert "worst relative error prefill 0%" in fitted.assumptions[-1]


def test_the_written_profile_is_one_pdd_plan_reads(profiles, tmp_path: Path) -> None:
    a = profiles["A"]
    fitted = fit_profile(_samples(a), 0.5)
    for name in ("chip.yaml", "chip.json"):
        write_profile(tmp_path / name, fitted.model_dump(mode="json"))
        assert load_profile(tmp_path / name) == fitted


def test_serving_is_what_the_served_ttfts_add_per_request_and_per_new_token(profiles) -> None:
    # served = engine + 0.05 s + 0.1 ms per new token, at two shapes
    samples = tuple(OverheadSample(n, c, e + 0.05 + 1e-4 * n, e)
                    for n, c, e in ((1024, 0, 1.3), (64, 1024, 0.13), (1024, 0, 1.35)))  # fmt: skip
    serving, worst = fit_serving(samples)
    assert serving.request_s == pytest.approx(0.05) and worst < 1e-9
    assert serving.per_new_token_s == pytest.approx(1e-4)
    fitted = fit_profile(Measured(**{**vars(_samples(profiles["A"])), "overhead": samples}), 1.0)
    assert fitted.serving == serving and "served minus engine TTFT of 3" in fitted.assumptions[-2]
    a = profiles["A"]  # the engine's prefill plus serving's per-token part
    assert fitted.prefill_s(1000, 0) == pytest.approx(a.prefill_s(1000, 0) + 0.1, rel=1e-6)


def test_serving_not_measured_or_below_noise_is_zero(profiles) -> None:
    assert fit_profile(_samples(profiles["A"]), 1.0).serving.request_s == 0.0
    one_shape = (OverheadSample(64, 1024, 0.12, 0.13), OverheadSample(64, 1024, 0.15, 0.13))
    serving, _ = fit_serving(one_shape)  # one shape: the median, never negative
    assert serving.request_s == pytest.approx(0.005) and serving.per_new_token_s == 0.0
    assert fit_serving(one_shape[:1])[0].request_s == 0.0


def test_nnls_keeps_coefficients_non_negative() -> None:
    # y = 2 + 3x, plus a column the free fit would weigh negatively
    rows = [[1.0, x, x * 1.01 - 0.5] for x in (1.0, 2.0, 3.0, 4.0)]
    coef = nnls(rows, [2.0 + 3.0 * x for x in (1.0, 2.0, 3.0, 4.0)])
    assert all(c >= 0 for c in coef)


def test_too_few_samples_name_the_form_and_what_it_needs(profiles) -> None:
    m = _samples(profiles["A"])
    one_batch = tuple(d for d in m.decode if d.batch == 1)
    with pytest.raises(ConfigError, match="decode: 1 distinct samples.*two batch sizes"):
        fit_profile(Measured(**{**vars(m), "decode": one_batch}), 1.0)
    with pytest.raises(ConfigError, match="prefill: 1 distinct samples"):
        fit_profile(Measured(**{**vars(m), "prefill": m.prefill[:1]}), 1.0)
    with pytest.raises(ConfigError, match="extend: 1 distinct"):
        fit_profile(Measured(**{**vars(m), "extend": m.extend[:1] * 3}), 1.0)


def test_a_time_that_is_not_positive_is_refused(profiles) -> None:
    m = _samples(profiles["A"])
    bad = (PrefillSample(100, 0, 0.0), *m.prefill[1:])
    with pytest.raises(ConfigError, match="prefill: times must be positive"):
        fit_profile(Measured(**{**vars(m), "prefill": bad}), 1.0)
    with pytest.raises(ConfigError, match="--price"):
        fit_profile(m, -1.0)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (Plan((64, 1000), (1, 2), (1, 8)), "1032 tokens do not fit max_model_len 1024"),
        (Plan((64,), (1, 2), (1, 8)), "--lengths: give at least two"),
        (Plan((64, 128), (1, 64), (1, 8)), r"--batches: .*\[1, 32\]"),
        (Plan((64, 128), (1, 2), (8,)), "--extend-tokens"),
        (Plan((64, 128), (1, 2), (1, 8), decode_tokens=2), "--decode-tokens"),
        (Plan((64, 128), (1, 2), (1, 8), served=1, served_tokens=1000), "--served-tokens"),
        (Plan((64, 128), (1, 2), (1, 8), served=-1), "--served: 0 or more"),
    ],
)
def test_a_plan_the_engine_cannot_run_is_refused_before_it_starts(plan: Plan, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan.check(max_model_len=1024, block=32, max_seqs=32)


def test_an_sla_no_fleet_of_the_measured_chip_meets_names_the_resource(
    profiles, tmp_path: Path, capsys
) -> None:
    slow = fit_profile(_samples(profiles["A"]), 1.0)
    path = tmp_path / "measured.yaml"
    write_profile(path, slow.model_dump(mode="json"))
    work = "agentic:requests=60,rate=1,context_tokens=16384,output_tokens=64"
    code = cli.main(["--profiles", str(path), "--wan", "10Gbps,40ms", "--sla",
                     "ttft=5,tpot=0.001", "--workload", work, "--modes", "pd_local"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "no fleet meets the SLA: decode step of chip A" in out
