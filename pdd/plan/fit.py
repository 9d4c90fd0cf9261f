"""A chip profile from measurements: the least-squares fit behind ``pdd profile``.

``pdd profile`` (pdd.profiler) times one worker's real engine and hands the samples here; this
module fits the closed forms of ``pdd.plan.profile`` (non-negative least squares, each form
linear in its coefficients) and returns a ``ChipProfile`` the planner reads like any other:

    prefill   seconds = ceil(new / chunk) * chunk_overhead_s + new * per_token_s
                        + new * (cached + new / 2) * per_token_context_s
    decode    step    = step_fixed_s + batch * per_seq_s + context * per_context_token_s
    extend    seconds = fixed_s + tokens * per_token_s
    serving   served TTFT - the engine's TTFT of the same shape
                      = request_s + new * per_new_token_s     (none measured: both 0)

Too few distinct samples to pin a form down is a ConfigError naming the form and what it
needs; the fit's worst relative error per form goes into the profile's ``assumptions``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pdd.errors import ConfigError
from pdd.plan.profile import (
    ChipProfile,
    DecodeProfile,
    ExtendProfile,
    MemoryProfile,
    PrefillProfile,
    ServingProfile,
)


@dataclass(frozen=True, slots=True)
class PrefillSample:
    new_tokens: int  # computed this forward
    cached_tokens: int  # prefix-cache hit
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    batch: int
    context_tokens: float  # KV tokens the batch reads per step (summed over sequences)
    step_s: float


@dataclass(frozen=True, slots=True)
class ExtendSample:
    tokens: int  # handed-off tokens recomputed in one forward (over a cached prefix)
    seconds: float


@dataclass(frozen=True, slots=True)
class OverheadSample:
    """One request's TTFT through a running one-worker pdd, and the engine's alone for a
    prompt of the same shape (new and cached tokens)."""

    new_tokens: int
    cached_tokens: int
    served_s: float
    engine_s: float


@dataclass(frozen=True)
class Measured:
    """What ``pdd profile`` measured on one worker kind (plus the facts it read)."""

    name: str
    model: str
    kv_bytes_per_token: int
    block_size: int
    chunk_tokens: int
    kv_capacity_tokens: int
    max_batch: int
    host_cache_tokens: int
    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]
    extend: tuple[ExtendSample, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)  # how it was measured
    overhead: tuple[OverheadSample, ...] = ()  # none: serving 0 (not measured)


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (active set: a coefficient the free fit
    makes negative is fixed at 0 and the rest refitted). Columns are scaled to unit norm
    first: their magnitudes differ by orders (1 vs tokens vs tokens squared)."""
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    free = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return [float(c) for c in coef / scale]


def _need(what: str, distinct: int, want: int, hint: str) -> None:
    if distinct < want:
        raise ConfigError(f"pdd profile: {what}: {distinct} distinct samples, the fit needs "
                          f"at least {want} ({hint})")  # fmt: skip


def _worst(pred: list[float], y: list[float]) -> float:
    return max(abs(p - v) / v for p, v in zip(pred, y, strict=True))


def _check(what: str, seconds: list[float]) -> None:
    bad = [s for s in seconds if not (s > 0 and math.isfinite(s))]
    if bad:
        raise ConfigError(f"pdd profile: {what}: times must be positive, got {bad[0]!r}")


def fit_prefill(samples: tuple[PrefillSample, ...], chunk: int) -> tuple[PrefillProfile, float]:
    _check("prefill", [s.seconds for s in samples])
    _need("prefill", len({(s.new_tokens, s.cached_tokens) for s in samples}), 3,
          "three prompt lengths, or cold and cached prompts")  # fmt: skip
    rows = [[math.ceil(s.new_tokens / chunk), s.new_tokens,
             s.new_tokens * (s.cached_tokens + s.new_tokens / 2)] for s in samples]  # fmt: skip
    y = [s.seconds for s in samples]
    over, per_tok, per_ctx = nnls(rows, y)
    prof = PrefillProfile(chunk_tokens=chunk, chunk_overhead_s=over, per_token_s=per_tok,
                          per_token_context_s=per_ctx)  # fmt: skip
    pred = [r[0] * over + r[1] * per_tok + r[2] * per_ctx for r in rows]
    return prof, _worst(pred, y)


def fit_decode(samples: tuple[DecodeSample, ...]) -> tuple[DecodeProfile, float]:
    _check("decode", [s.step_s for s in samples])
    _need("decode", len({s.batch for s in samples}), 2, "two batch sizes")
    _need("decode", len({(s.batch, s.context_tokens) for s in samples}), 3,
          "three (batch, context) points: two contexts at one batch size")  # fmt: skip
    rows = [[1.0, s.batch, s.context_tokens] for s in samples]
    y = [s.step_s for s in samples]
    fixed, per_seq, per_ctx = nnls(rows, y)
    prof = DecodeProfile(step_fixed_s=fixed, per_seq_s=per_seq, per_context_token_s=per_ctx)
    pred = [fixed + r[1] * per_seq + r[2] * per_ctx for r in rows]
    return prof, _worst(pred, y)


def fit_extend(samples: tuple[ExtendSample, ...]) -> tuple[ExtendProfile, float]:
    _check("extend", [s.seconds for s in samples])
    _need("extend", len({s.tokens for s in samples}), 2, "two handed-off token counts")
    rows = [[1.0, s.tokens] for s in samples]
    y = [s.seconds for s in samples]
    fixed, per_tok = nnls(rows, y)
    pred = [fixed + r[1] * per_tok for r in rows]
    return ExtendProfile(fixed_s=fixed, per_token_s=per_tok), _worst(pred, y)


def fit_serving(samples: tuple[OverheadSample, ...]) -> tuple[ServingProfile, float]:
    """What serving adds (``pdd.plan.profile.ServingProfile``) and the fit's worst absolute
    error in seconds; one new-token count pins the per-request part only."""
    _check("served TTFT", [x for s in samples for x in (s.served_s, s.engine_s)])
    if not samples:
        return ServingProfile(), 0.0
    y = [s.served_s - s.engine_s for s in samples]
    if len({s.new_tokens for s in samples}) < 2:
        return ServingProfile(request_s=max(0.0, float(np.median(y)))), 0.0
    rows = [[1.0, float(s.new_tokens)] for s in samples]
    request, per_token = nnls(rows, [max(v, 0.0) for v in y])
    worst = max(abs(request + r[1] * per_token - v) for r, v in zip(rows, y, strict=True))
    return ServingProfile(request_s=request, per_new_token_s=per_token), worst


def fit_profile(m: Measured, price_per_hour: float, description: str = "") -> ChipProfile:
    """The profile of ``m``'s chip kind. Raises ConfigError for samples that cannot be fit."""
    if price_per_hour < 0:
        raise ConfigError("pdd profile: --price must not be negative")
    prefill, e_p = fit_prefill(m.prefill, m.chunk_tokens)
    decode, e_d = fit_decode(m.decode)
    extend, e_e = fit_extend(m.extend)
    serving, e_s = fit_serving(m.overhead)
    fits = (f"Fit (non-negative least squares): worst relative error prefill {e_p:.0%} over "
            f"{len(m.prefill)} samples, decode {e_d:.0%} over {len(m.decode)}, extend "
            f"{e_e:.0%} over {len(m.extend)}.")  # fmt: skip
    served = (f"serving: served minus engine TTFT of {len(m.overhead)} requests, new tokens "
              f"and seconds: {', '.join(f'{s.new_tokens} {s.served_s - s.engine_s:+.3f}' for s in m.overhead)}; "
              f"fit's worst error {e_s * 1e3:.0f} ms." if m.overhead
              else "serving: not measured (0).")  # fmt: skip
    return ChipProfile(
        name=m.name, model=m.model, description=description, price_per_hour=price_per_hour,
        kv_bytes_per_token=m.kv_bytes_per_token, block_size=m.block_size,
        prefill=prefill, decode=decode, extend=extend,
        memory=MemoryProfile(kv_capacity_tokens=m.kv_capacity_tokens, max_batch=m.max_batch,
                             host_cache_tokens=m.host_cache_tokens),
        serving=serving,
        assumptions=[*m.notes, served, fits],
    )  # fmt: skip
