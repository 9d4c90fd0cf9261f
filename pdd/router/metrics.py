"""Router Prometheus metrics, in a registry of its own (never the global one).

Names follow vLLM's where the meaning is the same, prefixed ``pdd_``; histogram buckets are
vLLM 0.32's (``vllm/v1/metrics/buckets.py``). Labels are bounded: pipeline, finish_reason,
reason, handoff mode, tier (p | rld | md | d | colocated), worker id and role from the
config. Never request ids.

PDD series: route decisions by pipeline (counted at routing), and per closed request the
handoff (mode, rounds, stall: the gap between the last RLD token and the first MD token at
the switch), output tokens per tier, and the KV bytes P queued for MD (``pdd_wan_kv_bytes``).

Economics: TPOT per request, SLA goodput (requests within ``router.sla_ttft_s`` and
``router.sla_tpot_s``), and, set once from the config, each worker's cost per hour
(``router.cost_per_hour`` of its role) and the number of workers per role, so BCR =
goodput / sum(pdd_worker_cost_per_hour) is one PromQL expression (docs/operations.md).
Every name here is in ``pdd.observability.catalog`` (a test keeps the two equal).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from pdd.config import PddConfig
from pdd.protocol import HandoffMode, Pipeline, Role
from pdd.router.decide.view import FleetView
from pdd.router.record import RequestRecord

# vLLM 0.32 TIME_TO_FIRST_TOKEN_BUCKETS, INTER_TOKEN_LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

ROUNDS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
STALL_BUCKETS = ITL_BUCKETS
TPOT_BUCKETS = ITL_BUCKETS  # vLLM 0.32's request_time_per_output_token buckets

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """All router metrics. ``observe`` takes closed request records."""

    def __init__(self, cfg: PddConfig) -> None:
        self._sla = (cfg.router.sla_ttft_s, cfg.router.sla_tpot_s)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "pdd_time_to_first_token_seconds", "Request arrival to first token from a worker.",
            ["pipeline"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "pdd_inter_token_latency_seconds", "Time between successive token steps.",
            ["pipeline"], buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "pdd_e2e_request_latency_seconds", "Request arrival to finish.",
            ["pipeline"], buckets=E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "pdd_request_time_per_output_token_seconds", "Per request: (E2E - TTFT) / "
            "(output tokens - 1).", ["pipeline"], buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.sla_good = Counter(
            "pdd_sla_good_requests", "Finished requests within router.sla_ttft_s and "
            "router.sla_tpot_s.", ["pipeline"], registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "pdd_requests", "Finished requests.", ["finish_reason", "pipeline"], registry=r
        )
        self.prompt_tokens = Counter(
            "pdd_prompt_tokens", "Prompt tokens of finished requests.", ["pipeline"], registry=r
        )
        self.generation_tokens = Counter(
            "pdd_generation_tokens", "Generated tokens of finished requests.", ["pipeline"],
            registry=r,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "pdd_prompt_cached_tokens", "Prompt tokens served from a worker's prefix cache.",
            ["pipeline"], registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            "pdd_requests_rejected", "Requests refused before routing.", ["reason"], registry=r
        )
        self.in_flight = Gauge("pdd_requests_in_flight", "Requests admitted.", registry=r)
        self._pdd_metrics(r)
        self.worker_healthy = Gauge(
            "pdd_worker_healthy", "1 if the worker's last health poll succeeded.",
            ["worker", "role"], registry=r,
        )  # fmt: skip
        self.worker_in_flight = Gauge(
            "pdd_worker_requests_in_flight", "Requests this router has on the worker.",
            ["worker", "role"], registry=r,
        )  # fmt: skip
        self.worker_restarts = Counter(
            "pdd_worker_restarts", "Times the worker came back as a new process (its Health "
            "instance id changed): crashes, OOM kills, restarts by pdd serve or systemd.",
            ["worker", "role"], registry=r,
        )  # fmt: skip
        self._restarts_seen: dict[str, int] = {}
        self._cost_metrics(cfg, r)

    def _cost_metrics(self, cfg: PddConfig, r: CollectorRegistry) -> None:
        cost = Gauge(
            "pdd_worker_cost_per_hour", "Configured hardware cost per hour of the worker "
            "(router.cost_per_hour of its role).", ["worker", "role"], registry=r,
        )  # fmt: skip
        count = Gauge("pdd_workers", "Workers of each role in the fleet.", ["role"], registry=r)
        for role in Role:  # the roles the fleet has
            if any(w.role is role for w in cfg.workers):
                count.labels(role.value).set(sum(w.role is role for w in cfg.workers))
        for w in cfg.workers:
            cost.labels(w.id, w.role.value).set(getattr(cfg.router.cost_per_hour, w.role.value))

    def _pdd_metrics(self, r: CollectorRegistry) -> None:
        self.route_decisions = Counter(
            "pdd_route_decisions", "Requests routed, by the pipeline chosen.", ["pipeline"],
            registry=r,
        )  # fmt: skip
        self.handoffs = Counter(
            "pdd_handoffs", "Finished p_rld_md requests by handoff mode "
            "(one_shot | catch_up | rld_finished).", ["mode"], registry=r,
        )  # fmt: skip
        self.kv_deferred = Counter(
            "pdd_kv_deferred", "rld_finished requests whose KV to MD was left to land in the "
            "background (the next turn's prefix) instead of being cut.", registry=r,
        )  # fmt: skip
        self.md_computed = Counter(
            "pdd_md_computed", "Requests whose MD computed the prompt blocks it lacked itself "
            "instead of receiving their KV (recompute or wait, a wait given up, no room for "
            "the KV).", ["pipeline"], registry=r,
        )  # fmt: skip
        for pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD):  # 0 until MD computes, not absent
            self.md_computed.labels(pipeline.value)
        self.handoff_rounds = Histogram(
            "pdd_handoff_rounds", "MD Generate calls per handoff (warm-ups + the switch).",
            ["mode"], buckets=ROUNDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.handoff_stall = Histogram(
            "pdd_handoff_stall_seconds", "Gap between the last RLD token and the first MD "
            "token at a handoff switch.", ["mode"], buckets=STALL_BUCKETS, registry=r,
        )  # fmt: skip
        self.tier_tokens = Counter(
            "pdd_output_tokens", "Output tokens given to clients, by the tier that produced "
            "them.", ["tier"], registry=r,
        )  # fmt: skip
        self.wan_kv_bytes = Counter(
            "pdd_wan_kv_bytes", "KV bytes P queued for MD, after P's WAN codec (expected "
            "wire bytes; pd baselines: for D).", ["pipeline"], registry=r,
        )  # fmt: skip
        self.wan_kv_raw_bytes = Counter(
            "pdd_wan_kv_raw_bytes", "The same KV before P's WAN codec (raw bytes).",
            ["pipeline"], registry=r,
        )  # fmt: skip

    def observe(self, record: RequestRecord) -> None:
        pipeline = record.pipeline.value
        if record.ttft is not None:
            self.ttft.labels(pipeline).observe(record.ttft)
        itl = self.itl.labels(pipeline)
        for gap in record.inter_token_gaps:
            itl.observe(gap)
        if record.e2e is not None:
            self.e2e.labels(pipeline).observe(record.e2e)
        if record.tpot is not None:
            self.tpot.labels(pipeline).observe(record.tpot)
        if record.meets_sla(*self._sla):
            self.sla_good.labels(pipeline).inc()
        self.requests.labels(record.finish_reason or "error", pipeline).inc()
        self.prompt_tokens.labels(pipeline).inc(record.prompt_tokens)
        self.generation_tokens.labels(pipeline).inc(record.completion_tokens)
        self.cached_tokens.labels(pipeline).inc(record.cached_tokens)
        self._observe_pdd(record)

    def _observe_pdd(self, record: RequestRecord) -> None:
        t = record.trace
        for tier, n in t.tokens.items():
            self.tier_tokens.labels(tier).inc(n)
        if t.wan_kv_bytes:
            self.wan_kv_bytes.labels(t.pipeline.value).inc(t.wan_kv_bytes)
            self.wan_kv_raw_bytes.labels(t.pipeline.value).inc(t.wan_kv_raw_bytes)
        if t.kv_deferred:
            self.kv_deferred.inc()
        if t.md_computed:
            self.md_computed.labels(t.pipeline.value).inc()
        happened = t.handoff_rounds > 0 or t.handoff is HandoffMode.RLD_FINISHED
        if t.handoff is HandoffMode.NONE or not happened:
            return
        self.handoffs.labels(t.handoff.value).inc()
        self.handoff_rounds.labels(t.handoff.value).observe(t.handoff_rounds)
        if t.handoff_stall_s is not None:
            self.handoff_stall.labels(t.handoff.value).observe(t.handoff_stall_s)

    def update_fleet(self, view: FleetView) -> None:
        for w in view.workers:
            self.worker_healthy.labels(w.id, w.role.value).set(1 if w.healthy else 0)
            self.worker_in_flight.labels(w.id, w.role.value).set(w.in_flight)
            new = w.restarts - self._restarts_seen.get(w.id, 0)
            if new > 0:
                self.worker_restarts.labels(w.id, w.role.value).inc(new)
            self._restarts_seen[w.id] = w.restarts

    def render(self) -> bytes:
        return generate_latest(self.registry)
