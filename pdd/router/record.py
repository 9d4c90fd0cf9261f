"""The per-request record the router owns: route, timings, token counts, outcome.

Created when a request is routed, updated on every token event, closed exactly once when the
request ends for any reason (finish, stop string, client gone, error). Metrics and the
request log read closed records only. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.protocol import Pipeline
from pdd.router.routing import Decision


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    decision: Decision
    arrival: float
    routed_at: float
    prompt_tokens: int
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    inter_token_gaps: list[float] = field(default_factory=list)

    @property
    def pipeline(self) -> Pipeline:
        return self.decision.pipeline

    def on_tokens(self, n_tokens: int, now: float) -> None:
        """A worker step produced ``n_tokens`` (>0) tokens at ``now``."""
        if n_tokens <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            assert self.last_token_at is not None
            self.inter_token_gaps.append(now - self.last_token_at)
        self.last_token_at = now

    def close(self, now: float, finish_reason: str, completion_tokens: int, cached: int) -> None:
        assert self.finished_at is None, "a request record is closed exactly once"
        self.finished_at = now
        self.finish_reason = finish_reason
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival

    def log_line(self) -> str:
        workers = ",".join(f"{role.value}={wid}" for role, wid in self.decision.assignments)
        ttft = f"{self.ttft * 1000:.1f}ms" if self.ttft is not None else "-"
        e2e = f"{self.e2e * 1000:.1f}ms" if self.e2e is not None else "-"
        return (
            f"request {self.request_id} pipeline={self.pipeline.value} {workers} "
            f"prompt={self.prompt_tokens} cached={self.cached_tokens} "
            f"completion={self.completion_tokens} ttft={ttft} e2e={e2e} "
            f"finish={self.finish_reason}" + (f" error={self.error!r}" if self.error else "")
        )
