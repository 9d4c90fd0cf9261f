"""The per-request record the router owns: route, timings, token counts, outcome, PDD trace.

Created when a request is routed, updated on every token event, closed exactly once when the
request ends for any reason (finish, stop string, client gone, error). Metrics and the
request log read closed records only; ``/debug/requests/{id}`` (``pdd.router.debug``) reads
open ones too. Times are ``time.monotonic()`` seconds.

``timeline`` is what happened to the request, in order: the route decision, each RPC to a
worker (``pdd.router.debug`` turns them into entries), the first token from each worker,
the finish. Entries are appended on the event loop only.

``PddTrace`` is the part the pipeline driver writes while it runs (what it actually did: the
bytes P queued for MD, tokens per tier, the handoff), and it becomes the ``pdd`` object of
the response (``summary()``): the final stream chunk (the one with ``finish_reason``) and the
whole non-streamed body carry it.

    pipeline          colocated | pd | p_md | p_rld_md
    md_cached_tokens  prompt tokens MD already held (PrepareKv's answer; before it: the view)
    wan_kv_bytes      bytes expected on the WAN for the MD destination, after P's codec (SendKv's
                      answer: raw x the codec's learned ratio; pd baselines: for D)
    wan_kv_raw_bytes  the same KV before the codec (equal to wan_kv_bytes without one)
    rld_tokens        tokens the client got from RLD
    handoff           none | one_shot | catch_up | rld_finished
    handoff_rounds    MD Generate calls made for the handoff (warm-ups + the switch)
    p, rld, md        the instances that served it (worker ids, as `pdd status` lists them);
                      null for a tier the request did not use (pd baselines: md is D)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.protocol import HandoffMode, Pipeline, Role
from pdd.router.decide.view import Decision
from pdd.router.types import PddSummary

TIERS = ("p", "rld", "md", "d", "colocated")
_TIER_OF_ROLE = {
    Role.PREFILL: "p",
    Role.RELAY_DECODE: "rld",
    Role.MAIN_DECODE: "md",
    Role.COLOCATED: "colocated",
}


def tier_of(role: Role) -> str:
    return _TIER_OF_ROLE[role]


@dataclass(slots=True)
class PddTrace:
    """What the driver did for one request. Written by the driver, read at close."""

    pipeline: Pipeline
    prompt_tokens: int
    p: str | None = None
    rld: str | None = None
    md: str | None = None
    md_cached_tokens: int = 0
    wan_kv_bytes: int = 0
    wan_kv_raw_bytes: int = 0
    handoff: HandoffMode = HandoffMode.NONE
    handoff_rounds: int = 0
    tokens: dict[str, int] = field(default_factory=dict)  # tier -> tokens given to the client
    handoff_stall_s: float | None = None  # last RLD token -> first MD token at the switch
    kv_state: str = ""  # AwaitKv's final state on MD (or D), "" when not awaited
    kv_reason: str = ""  # why it ended so, when it did not end done
    kv_deferred: bool = False  # rld_finished: MD's KV still lands, in the background
    d_is_rld: bool = False  # D is a relay_decode worker: its tokens count as RLD's
    md_computed: bool = False  # MD computed the blocks it lacked (recompute, or no room)

    @classmethod
    def for_decision(cls, decision: Decision, prompt_tokens: int) -> PddTrace:
        if decision.pipeline is Pipeline.COLOCATED:
            return cls(decision.pipeline, prompt_tokens)
        if decision.relay_only:  # the test-only p_rld_only policy: RLD emits every token
            trace = cls(decision.pipeline, prompt_tokens, p=decision.maybe_worker(Role.PREFILL),
                        rld=decision.worker(Role.RELAY_DECODE))  # fmt: skip
            trace.d_is_rld = True
            return trace
        return cls(
            decision.pipeline,
            prompt_tokens,
            p=decision.maybe_worker(Role.PREFILL),
            rld=decision.maybe_worker(Role.RELAY_DECODE),
            md=decision.decoder,
            md_cached_tokens=decision.md_cached_tokens,
            handoff=decision.handoff,
        )

    def count(self, tier: str, n: int) -> None:
        if tier == "d" and self.d_is_rld:
            tier = "rld"
        self.tokens[tier] = self.tokens.get(tier, 0) + n

    def summary(self) -> PddSummary:
        return PddSummary(
            pipeline=self.pipeline.value,
            prompt_tokens=self.prompt_tokens,
            md_cached_tokens=self.md_cached_tokens,
            wan_kv_bytes=self.wan_kv_bytes,
            wan_kv_raw_bytes=self.wan_kv_raw_bytes,
            rld_tokens=self.tokens.get("rld", 0),
            handoff=self.handoff.value,
            handoff_rounds=self.handoff_rounds,
            md_computed=self.md_computed,
            p=self.p,
            rld=self.rld,
            md=self.md,
        )


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One step of a request: ``at`` (monotonic), what (``event``), on which worker."""

    at: float
    event: str
    worker: str | None = None
    detail: dict[str, object] = field(default_factory=dict)


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
    timeline: list[TimelineEvent] = field(default_factory=list)
    trace: PddTrace = field(init=False)
    _seen_workers: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.trace = PddTrace.for_decision(self.decision, self.prompt_tokens)

    def mark(self, at: float, event: str, worker: str | None = None, **detail: object) -> None:
        """Append a timeline entry (called on the event loop)."""
        self.timeline.append(TimelineEvent(at, event, worker, detail))

    @property
    def pipeline(self) -> Pipeline:
        return self.decision.pipeline

    def on_tokens(self, n_tokens: int, now: float, worker: str = "") -> None:
        """A worker step produced ``n_tokens`` (>0) tokens at ``now``."""
        if n_tokens <= 0:
            return
        if worker and worker not in self._seen_workers:
            self._seen_workers.add(worker)
            self.mark(now, "first_token", worker, tokens=n_tokens)
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

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output tokens - 1)."""
        if self.completion_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def meets_sla(self, ttft_s: float, tpot_s: float) -> bool:
        """Finished normally within both limits (one-token requests have no TPOT to miss)."""
        if self.finish_reason not in ("stop", "length") or self.ttft is None:
            return False
        tpot = self.tpot
        return self.ttft <= ttft_s and (tpot is None or tpot <= tpot_s)

    def log_line(self) -> str:
        workers = ",".join(f"{role.value}={wid}" for role, wid in self.decision.assignments)
        ttft = f"{self.ttft * 1000:.1f}ms" if self.ttft is not None else "-"
        e2e = f"{self.e2e * 1000:.1f}ms" if self.e2e is not None else "-"
        t = self.trace
        pdd = ""
        if self.pipeline is not Pipeline.COLOCATED:
            pdd = (
                f" md_cached={t.md_cached_tokens} wan_bytes={t.wan_kv_bytes} "
                f"handoff={t.handoff.value}/{t.handoff_rounds} tokens={t.tokens} "
                f"kv={t.kv_state or '-'}"
            )
        return (
            f"request {self.request_id} pipeline={self.pipeline.value} {workers} "
            f"prompt={self.prompt_tokens} cached={self.cached_tokens} "
            f"completion={self.completion_tokens} ttft={ttft} e2e={e2e} "
            f"finish={self.finish_reason}{pdd}" + (f" error={self.error!r}" if self.error else "")
        )
