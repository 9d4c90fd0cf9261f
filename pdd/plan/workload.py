"""Workloads the planner simulates: a synthetic agentic generator and a JSONL trace.

Both give conversations of turns. A conversation is one token stream: turn k's prompt is the
first ``prompt_tokens`` tokens of it, and each turn's prompt extends the previous turn's prompt
and answer (the chain shape of agents that re-send the whole history). Only sizes matter to
the planner, never text: a block of the stream is named by (conversation, block index).

Synthetic agentic (``AgenticWorkload``): conversations start as a Poisson process at
``rate / turns`` per second; turn k+1 is sent ``think_s`` (exponential mean) after turn k
ended. With T turns, new tokens D per turn, O output tokens and a first prompt c0:

    p_k = c0 + k * (O + D)                       prompt of turn k
    hit_k = (p_{k-1} + O) / p_k,  hit_0 = 0       the prefix an ideal cache of the history holds
    mean_k p_k = context_tokens,  mean_k hit_k = hit_rate   (solved for c0 and D)

``turns: 0`` picks T from the hit rate (about 2 / (1 - hit_rate)). Each conversation scales c0
and D by a uniform factor in [1 - jitter, 1 + jitter].

Trace (JSONL, one request a line; blank lines skipped, unknown fields ignored)::

    {"timestamp": 12.5, "conversation_id": "c7", "prompt_tokens": 65536, "output_tokens": 1024}

A turn is sent at its timestamp's offset from the first line, or when its conversation's
previous turn ends if that is later. Bad lines are reported with their line numbers. Two
optional fields:

    prefix_tokens  the leading tokens this prompt shares with its conversation so far (the
                   previous prompt and answer); what follows is new text, so every cache drops
                   the conversation's blocks past it (an agent that re-sends the history but
                   not its own answer: the previous prompt's length). Default: all of it.
    prefix_of      with prefix_tokens: the conversation (an id of the trace) whose stream those
                   leading tokens come from, as it stands when this turn is sent (an agent
                   that spawns a sub-task from another conversation's history). Each cache
                   then holds this conversation's copy of what it held of them (their blocks
                   are counted twice against its capacity: a radix cache would share them).
    measured       false: a warm-up request (it fills caches; the summary leaves it out and
                   measures from the first measured arrival to the last measured end).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdd.config.base import Section
from pdd.errors import ConfigError

MAX_REPORTED = 10


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int
    output_tokens: int
    at_s: float | None = None  # trace: offset from the first line; None: after think_s
    think_s: float = 0.0  # synthetic: wait after the previous turn ended
    prefix_tokens: int | None = None  # trace: tokens shared with the stream so far (None: all)
    prefix_of: int | None = None  # trace: the conversation they come from (None: this one)
    measured: bool = True  # trace: False for a warm-up request


@dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    conversations: tuple[Conversation, ...]

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


class AgenticWorkload(Section):
    """A synthetic agentic workload (see the module docstring for the formulas)."""

    requests: int = Field(2000, gt=0, description="Requests (turns) in all.")
    rate: float = Field(2.0, gt=0, description="Offered load, requests per second.")
    context_tokens: int = Field(65536, gt=0, description="Mean prompt length (tokens).")
    hit_rate: float = Field(0.9, ge=0, lt=1, description="Mean prefix hit of the prompts.")
    output_tokens: int = Field(1024, gt=0, description="Output tokens per request.")
    turns: int = Field(0, ge=0, description="Turns per conversation; 0: from the hit rate.")
    think_s: float = Field(2.0, ge=0, description="Mean pause between turns (tool time).")
    jitter: float = Field(0.2, ge=0, lt=1, description="Per-conversation size spread.")
    seed: int = Field(0, description="Random seed.")


def _shape(w: AgenticWorkload, turns: int, new: float) -> tuple[float, float]:
    """(c0, mean hit) for T turns and D new tokens per turn."""
    o, step = w.output_tokens, w.output_tokens + new
    c0 = w.context_tokens - (turns - 1) / 2 * step
    if c0 <= 0:  # no first prompt: not a shape
        return c0, 0.0
    hits = [(c0 + (k - 1) * step + o) / (c0 + k * step) for k in range(1, turns)]
    return c0, sum(hits) / turns


def solve_shape(w: AgenticWorkload) -> tuple[int, float, float]:
    """(turns, first prompt c0, new tokens D per turn) meeting the mean context and hit."""
    turns = w.turns or max(1, min(400, round(2 / (1 - w.hit_rate)))) if w.hit_rate > 0 else 1
    if w.hit_rate == 0:
        if w.turns > 1:
            raise ConfigError("workload: hit_rate 0 needs turns 1 (every request is cold)")
        return 1, float(w.context_tokens), 0.0
    for _ in range(400):
        c0, top = _shape(w, turns, 0.0)
        if c0 > 0 and top >= w.hit_rate:
            break
        if w.turns:
            raise ConfigError(
                f"workload: hit_rate {w.hit_rate} is out of reach with turns {w.turns} "
                f"(at most {max(top, 0):.3f} with context_tokens {w.context_tokens}, "
                f"output_tokens {w.output_tokens}); give more turns or turns: 0"
            )
        if c0 <= 0:  # the first prompt vanished: the most turns that leave one (the best hit)
            most = math.ceil(2 * w.context_tokens / w.output_tokens)
            c0, top = _shape(w, most, 0.0) if most < turns else (c0, top)
            if c0 <= 0 or top < w.hit_rate:
                raise ConfigError(
                    f"workload: hit_rate {w.hit_rate} is out of reach with context_tokens "
                    f"{w.context_tokens} and output_tokens {w.output_tokens} (every turn adds "
                    "its answer to the context); lower hit_rate or output_tokens, or raise "
                    "context_tokens"
                )
            turns = most
            break
        turns += 1
    lo, hi = 0.0, 2 * w.context_tokens / max(turns - 1, 1)
    for _ in range(60):  # the mean hit falls as D grows; c0 stays positive below hi
        mid = (lo + hi) / 2
        c0, hit = _shape(w, turns, mid)
        lo, hi = (mid, hi) if c0 > 0 and hit > w.hit_rate else (lo, mid)
    c0, _ = _shape(w, turns, lo)
    return turns, c0, lo


def agentic(w: AgenticWorkload) -> Workload:
    turns, c0, new = solve_shape(w)
    rng = random.Random(w.seed)
    convs: list[Conversation] = []
    t, left = 0.0, w.requests
    while left > 0:
        t += rng.expovariate(w.rate / turns)
        f = rng.uniform(1 - w.jitter, 1 + w.jitter)
        n = min(turns, left)
        step = w.output_tokens + new * f
        out = tuple(
            Turn(max(1, round(c0 * f + k * step)), w.output_tokens, None,
                 rng.expovariate(1 / w.think_s) if w.think_s > 0 and k else 0.0)
            for k in range(n)
        )  # fmt: skip
        convs.append(Conversation(len(convs), t, out))
        left -= n
    return Workload(f"agentic(hit={w.hit_rate}, context={w.context_tokens})", tuple(convs))


class _TraceLine(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timestamp: float
    conversation_id: str | int | None = None
    prompt_tokens: int = Field(..., gt=0, strict=True)
    output_tokens: int = Field(..., gt=0, strict=True)
    prefix_tokens: int | None = Field(None, ge=0, strict=True)
    prefix_of: str | int | None = None
    measured: bool = Field(True, strict=True)


def load_trace(path: Path) -> Workload:
    """A JSONL trace (see the module docstring). ConfigError lists the bad lines."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"trace {path}: cannot read it ({exc.strerror})") from None
    parsed: list[_TraceLine] = []
    bad: list[str] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            parsed.append(_TraceLine.model_validate(json.loads(line)))
        except json.JSONDecodeError as exc:
            bad.append(f"line {no}: not JSON ({exc.msg})")
        except ValidationError as exc:
            fields = ", ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            bad.append(f"line {no}: {fields}")
    if bad:
        more = f" (and {len(bad) - MAX_REPORTED} more)" if len(bad) > MAX_REPORTED else ""
        raise ConfigError(f"trace {path}: " + "; ".join(bad[:MAX_REPORTED]) + more)
    if not parsed:
        raise ConfigError(f"trace {path}: no requests")
    t0 = min(p.timestamp for p in parsed)
    groups: dict[object, list[_TraceLine]] = {}
    for i, p in enumerate(parsed):
        groups.setdefault(
            p.conversation_id if p.conversation_id is not None else ("#", i), []
        ).append(p)
    number = {cid: n for n, cid in enumerate(groups)}
    unknown = sorted({str(p.prefix_of) for p in parsed
                      if p.prefix_of is not None and p.prefix_of not in number})  # fmt: skip
    if unknown:
        raise ConfigError(f"trace {path}: prefix_of names no conversation of the trace: "
                          + ", ".join(unknown[:MAX_REPORTED]))  # fmt: skip
    convs = []
    for lines_of in groups.values():
        lines_of.sort(key=lambda p: p.timestamp)
        turns = tuple(
            Turn(p.prompt_tokens, p.output_tokens, p.timestamp - t0,
                 prefix_tokens=p.prefix_tokens, measured=p.measured,
                 prefix_of=None if p.prefix_of is None else number[p.prefix_of])
            for p in lines_of
        )  # fmt: skip
        convs.append(Conversation(len(convs), turns[0].at_s or 0.0, turns))
    return Workload(f"trace({Path(path).name})", tuple(convs))
