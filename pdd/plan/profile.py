"""Chip profiles: what one worker of a chip kind costs in time, memory and money.

A profile is a YAML (or JSON) file, one chip kind running one model, written from published
figures or measured (``pdd profile``, a later step, will write the same schema). The planner
reads only these numbers; every time model is a small closed form so a profile can be written
by hand and checked by eye::

    prefill(new, cached)  = ceil(new / chunk_tokens) * chunk_overhead_s     (one forward per
                            + paid(new) * per_token_s                         chunk: a tail
                            + new * (cached + new / 2) * per_token_context_s  chunk pays it too)
    paid(new)             = the new tokens, each forward counted as at least
                            min_forward_tokens (the roofline's knee, 0 by default: below it a
                            forward is bound by reading the weights, so a small tail chunk
                            costs what a forward of min_forward_tokens does)
    forward_buckets       static shapes (empty by default: dynamic, as vLLM on GPUs): each
                            forward's GEMMs run padded to the smallest bucket that holds its
                            tokens (attention, a ragged kernel, over the real tokens only), so
                            a small tail chunk pays for its bucket
    decode_step(batch, ctx) = step_fixed_s + batch * per_seq_s + ctx * per_context_token_s
                            (ctx: KV tokens the batch reads this step, summed over sequences)
    extend(tokens)        = fixed_s + tokens * per_token_s    (one multi-token forward on MD)

What serving adds outside the engine (``serving``; measured by ``pdd profile`` through a
one-worker pdd, 0 in a datasheet profile): ``request_s`` once per request, before its first
worker starts it (the router's HTTP and tokenizer, gRPC, the stream back), and
``per_new_token_s`` on every prefill's new tokens (what the serving processes take from the
engine's cores while it computes), so ``prefill`` above is the engine's plus that.

Memory: ``kv_capacity_tokens`` of device KV (running sequences' context must fit), at most
``max_batch`` sequences, and ``host_cache_tokens`` of host-memory KV tier (MainDecode's DRC;
on P and colocated workers the prefix cache is the device KV only).

``extends: other.yaml`` (a path relative to the file) starts from another profile and
overrides what this file gives, mapping by mapping: a chip variant in a few lines.

Errors: ``load_profile`` raises ConfigError naming the file and each missing or bad field.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from pdd.config.base import Section
from pdd.errors import ConfigError


class PrefillProfile(Section):
    """Prefill time against new (computed) and cached (prefix-hit) tokens."""

    chunk_tokens: int = Field(..., gt=0, description="Chunked-prefill chunk size (tokens).")
    chunk_overhead_s: float = Field(
        ..., ge=0, description="Fixed cost of one prefill forward (kernel launches, weights read)."
    )
    per_token_s: float = Field(..., ge=0, description="Linear cost per new token (GEMMs).")
    per_token_context_s: float = Field(
        ..., ge=0, description="Attention cost per new token per context token it attends to."
    )
    min_forward_tokens: int = Field(
        0,
        ge=0,
        description="A forward of fewer new tokens costs as many (the roofline's knee: weights "
        "read / compute per token; an MoE's is thousands, since each expert sees a share).",
    )
    forward_buckets: list[int] = Field(
        default_factory=list,
        description="Static shapes (a graph-compiled engine): token counts a forward is padded "
        "to, ascending, the last at least chunk_tokens. Empty: dynamic shapes, no padding.",
    )

    @model_validator(mode="after")
    def _buckets_hold_a_chunk(self) -> PrefillProfile:
        b = self.forward_buckets
        if b and (b != sorted(set(b)) or b[0] <= 0 or b[-1] < self.chunk_tokens):
            raise ValueError(
                f"forward_buckets must be positive and ascending, the last at least "
                f"chunk_tokens ({self.chunk_tokens}); got {b}"
            )
        return self

    def shaped(self, tokens: int) -> int:
        """The tokens a forward of ``tokens`` new tokens computes (its bucket, or itself)."""
        i = bisect.bisect_left(self.forward_buckets, tokens)
        return self.forward_buckets[i] if i < len(self.forward_buckets) else tokens

    def attention_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Attention of ``new_tokens`` over the cached prefix and each other (causal)."""
        return new_tokens * (cached_tokens + new_tokens / 2) * self.per_token_context_s


class DecodeProfile(Section):
    """Decode step time against batch size and the KV the batch reads."""

    step_fixed_s: float = Field(..., ge=0, description="Per step, independent of the batch.")
    per_seq_s: float = Field(..., ge=0, description="Per sequence in the batch, per step.")
    per_context_token_s: float = Field(
        ..., ge=0, description="Per KV token read per step (memory bandwidth bound)."
    )


class ExtendProfile(Section):
    """Extend-decode: recomputing handed-off tokens in one multi-token forward on MD."""

    fixed_s: float = Field(..., ge=0, description="Cost of the extra forward.")
    per_token_s: float = Field(..., ge=0, description="Per handed-off token recomputed.")


class MemoryProfile(Section):
    kv_capacity_tokens: int = Field(
        ..., gt=0, description="Device KV cache in tokens (all running sequences' context)."
    )
    max_batch: int = Field(..., gt=0, description="Largest decode batch (sequences).")
    host_cache_tokens: int = Field(
        ..., ge=0, description="Host-memory KV tier in tokens (MainDecode's DRC capacity)."
    )


class ServingProfile(Section):
    """What pdd's serving path adds to the engine's times (both 0: not measured)."""

    request_s: float = Field(
        0.0, ge=0, description="Per request, before its first worker starts it (router, gRPC)."
    )
    per_new_token_s: float = Field(
        0.0, ge=0, description="Per new prompt token, on top of the engine's prefill."
    )


class ChipProfile(Section):
    """One chip kind running one model (see the module docstring for the formulas)."""

    name: str = Field(..., min_length=1, description="Chip kind, e.g. A or B.")
    description: str = Field("", description="What this chip is and where the numbers come from.")
    model: str = Field(..., min_length=1, description="The model the figures are for.")
    price_per_hour: float = Field(..., ge=0, description="Cost of one instance per hour.")
    kv_bytes_per_token: int = Field(..., gt=0, description="KV bytes per token, all layers.")
    block_size: int = Field(..., gt=0, description="Tokens per KV block (prefix-cache unit).")
    prefill: PrefillProfile
    decode: DecodeProfile
    extend: ExtendProfile
    memory: MemoryProfile
    serving: ServingProfile = Field(
        default_factory=ServingProfile,
        description="What serving adds outside the engine (`pdd profile` measures it).",
    )
    assumptions: list[str] = Field(
        default_factory=list, description="Every assumption behind the figures, with sources."
    )

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        p = self.prefill
        new_tokens = max(new_tokens, 0)  # 0: the one forward that emits the first token
        full, tail = divmod(new_tokens, p.chunk_tokens)
        forwards = full + (tail > 0 or not full)
        paid = new_tokens  # the GEMMs' rows: each forward's bucket, at least the knee's tokens
        if p.forward_buckets or p.min_forward_tokens:
            sizes = [p.chunk_tokens] * full + ([tail] if tail or not full else [])
            paid = sum(max(p.shaped(n), p.min_forward_tokens) for n in sizes)
        gemm = paid * p.per_token_s + new_tokens * self.serving.per_new_token_s
        attention = p.attention_s(new_tokens, cached_tokens)
        return forwards * p.chunk_overhead_s + gemm + attention

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        d = self.decode
        return d.step_fixed_s + batch * d.per_seq_s + context_tokens * d.per_context_token_s

    def extend_s(self, tokens: int) -> float:
        return self.extend.fixed_s + tokens * self.extend.per_token_s


def _explain(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"])
        if e["type"] == "missing":
            parts.append(f"missing field {where!r}")
        else:
            parts.append(f"field {where!r}: {e['msg']}")
    return "; ".join(parts)


def load_profile(path: Path) -> ChipProfile:
    """Read one profile (YAML or JSON). Raises ConfigError naming the file and the field."""
    data = _fields(Path(path), ())
    try:
        return ChipProfile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"profile {path}: {_explain(exc)}") from None


def _fields(path: Path, chain: tuple[Path, ...]) -> dict:
    """The file's fields over those of the profile it ``extends`` (``chain``: the files that
    extend it, to refuse a cycle)."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"profile {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"profile {path}: not YAML/JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"profile {path}: expected a mapping of fields at the top level")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"profile {path}: 'extends' must name one profile file")
    if path.resolve() in chain:
        raise ConfigError(f"profile {path}: 'extends' goes round in a cycle")
    return _merged(_fields(path.parent / base, (*chain, path.resolve())), data)


def _merged(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s fields, mappings merged field by field."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def load_profiles(paths: list[Path]) -> dict[str, ChipProfile]:
    """Profiles by chip name; two files naming the same chip are refused."""
    out: dict[str, ChipProfile] = {}
    for path in paths:
        prof = load_profile(path)
        if prof.name in out:
            raise ConfigError(f"profile {path}: chip name {prof.name!r} is given twice")
        out[prof.name] = prof
    return out
