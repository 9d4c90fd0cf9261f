"""Replay of a user's JSONL trace.

One JSON object per line (blank lines are skipped, unknown fields ignored)::

    {"timestamp": 12.5, "conversation_id": "c7", "messages": [{"role": "user",
     "content": "..."}], "max_tokens": 64}
    {"timestamp": 13.0, "prompt": "raw text for /v1/completions", "max_tokens": 16}

``timestamp`` is in seconds (any origin); requests are replayed at their offsets from the first
measured one, divided by ``trace.speed``. Every bad line is reported with its line number in
one ``ConfigError``; nothing is replayed from a file with a bad line.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdd.bench.serve.config import TraceConfig
from pdd.bench.serve.workload import BenchRequest, Group, Workload
from pdd.errors import ConfigError

GROUP = "trace"
MAX_REPORTED = 20


class _TraceMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str = Field(..., min_length=1)
    content: str


class _TraceLine(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timestamp: float
    conversation_id: str | None = None
    messages: list[_TraceMessage] | None = Field(None, min_length=1)
    prompt: str | None = Field(None, min_length=1)
    max_tokens: int = Field(..., gt=0, strict=True)

    @model_validator(mode="after")
    def _one_input(self) -> _TraceLine:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages and prompt")
        return self


def _explain(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def parse_trace(path: Path) -> list[tuple[int, _TraceLine]]:
    """(line number, parsed line) for every non-blank line; ConfigError lists every bad one."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"trace file not found: {p}")
    good: list[tuple[int, _TraceLine]] = []
    errors: list[str] = []
    with p.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                errors.append(f"{p}:{lineno}: not valid JSON ({exc.msg})")
                continue
            if not isinstance(obj, dict):
                errors.append(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
                continue
            try:
                good.append((lineno, _TraceLine.model_validate(obj)))
            except ValidationError as exc:
                errors.append(f"{p}:{lineno}: {_explain(exc)}")
    if errors:
        shown = errors[:MAX_REPORTED]
        more = len(errors) - len(shown)
        tail = f"\n  ... and {more} more" if more else ""
        raise ConfigError(
            f"{len(errors)} bad line(s) in trace {p}:\n  " + "\n  ".join(shown) + tail
        )
    if not good:
        raise ConfigError(f"trace {p} holds no requests")
    return good


def load_trace(path: Path, cfg: TraceConfig) -> Workload:
    """The trace as a workload: earliest first, turns of a conversation chained by ``after``."""
    lines = sorted(parse_trace(path), key=lambda item: item[1].timestamp)
    if cfg.max_requests is not None:
        lines = lines[: cfg.max_requests]
    if cfg.warmup_requests >= len(lines):
        raise ConfigError(
            f"trace.warmup_requests={cfg.warmup_requests} leaves none of {len(lines)} requests"
        )
    t0 = lines[cfg.warmup_requests][1].timestamp
    last_of: dict[str, int] = {}
    requests: list[BenchRequest] = []
    for index, (lineno, line) in enumerate(lines):
        conv = line.conversation_id or f"line{lineno}"
        warm = index < cfg.warmup_requests
        msgs = tuple((m.role, m.content) for m in line.messages or ())
        requests.append(
            BenchRequest(
                index=index,
                group=GROUP,
                warmup=warm,
                conversation=conv,
                max_tokens=line.max_tokens,
                messages=msgs,
                prompt=line.prompt,
                after=last_of.get(conv) if cfg.wait_for_previous_turn else None,
                arrival_s=None if warm else (line.timestamp - t0) / cfg.speed,
            )
        )
        last_of[conv] = index
    return Workload("trace", [Group(GROUP)], requests)
