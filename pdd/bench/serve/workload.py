"""What a workload is: an ordered list of requests in phases, each request typed.

A workload is generated once per run from a seed, before any mode runs, so every mode sees
byte-identical requests. Requests are grouped: each group (the whole agentic run, one sweep
bucket, the trace) runs as one phase: its warm-up requests first (not measured), then its
measured requests under the load pattern. ``after`` orders requests that build on each other:
a turn is sent only once the request that sent its prefix has ended.

The workload generators (agentic, sweep, trace, turns) build on these types; ``build`` picks one by
name (so this module imports none of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload (chat messages, or a raw prompt for /v1/completions)."""

    index: int
    group: str
    warmup: bool
    conversation: str
    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str | None = None
    prompt_tokens: int | None = None  # expected prompt length; None when unknown (trace)
    shared_tokens: int | None = None  # leading tokens shared with an earlier request
    after: int | None = None  # index of the request that must end before this one starts
    arrival_s: float | None = None  # trace replay: offset from the phase start
    anomaly: bool = False

    @property
    def target_hit(self) -> float | None:
        """The prefix hit rate an ideal cache would give this request."""
        if not self.prompt_tokens or self.shared_tokens is None:
            return None
        return self.shared_tokens / self.prompt_tokens

    def endpoint(self) -> str:
        return "/completions" if self.prompt is not None else "/chat/completions"

    def payload(self) -> dict[str, Any]:
        """The request body (without model and sampling fields the runner adds)."""
        if self.prompt is not None:
            return {"prompt": self.prompt, "max_tokens": self.max_tokens}
        msgs = [{"role": r, "content": c} for r, c in self.messages]
        return {"messages": msgs, "max_tokens": self.max_tokens}


@dataclass(frozen=True, slots=True)
class Group:
    """One phase of a workload; ``hit`` is the sweep bucket it measures (None otherwise)."""

    name: str
    hit: float | None = None


@dataclass
class Workload:
    name: str
    groups: list[Group]
    requests: list[BenchRequest] = field(default_factory=list)
    token_model: str = "estimate"

    def phase(self, group: str, warmup: bool) -> list[BenchRequest]:
        return [r for r in self.requests if r.group == group and r.warmup == warmup]

    def max_context(self) -> int:
        """Largest prompt + max_tokens of any request with a known prompt length."""
        return max(
            ((r.prompt_tokens or 0) + r.max_tokens for r in self.requests if r.prompt_tokens),
            default=0,
        )
