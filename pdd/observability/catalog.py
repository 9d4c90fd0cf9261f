"""The catalog: every metric a pdd process exports, in one list.

Each entry names the metric as Prometheus scrapes it (counters end in ``_total``; a histogram
is the family whose ``_bucket``, ``_sum`` and ``_count`` series are scraped), its type, unit,
labels and the processes that export it. ``deploy/grafana/pdd-dashboard.json`` may only read
names from here (``tests/observability/test_dashboard.py``), the router must register exactly
its own entries (``test_router_metrics.py``), and a running system must export every entry
the dashboard reads (``tests/observability/live.py``). ``status`` says whether the exporter has it
today: ``built`` or ``planned`` (the code does not export it yet).

Labels come from a closed set (``PDD_LABELS``): never request ids or anything unbounded.
vLLM's own engine metrics (``vllm:*``, labels ``model_name`` and ``engine``) are listed too:
every worker serves them next to its own.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Kind(enum.StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


ROUTER = "router"
PREFILL = "prefill"
RELAY_DECODE = "relay_decode"
MAIN_DECODE = "main_decode"
COLOCATED = "colocated"
WORKERS = frozenset({PREFILL, RELAY_DECODE, MAIN_DECODE, COLOCATED})
KV_WORKERS = frozenset({PREFILL, RELAY_DECODE, MAIN_DECODE})
PROCESSES = WORKERS | {ROUTER}

# The closed label set of pdd_* metrics. worker ids come from the config (bounded too).
PDD_LABELS = frozenset(
    {"pipeline", "role", "transport", "outcome", "mode", "finish_reason", "reason", "tier",
     "worker", "rpc"}
)  # fmt: skip
VLLM_LABELS = ("model_name", "engine")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # as scraped (counters with _total; histograms: the family name)
    kind: Kind
    unit: str
    labels: tuple[str, ...]
    exporters: frozenset[str]  # router and/or worker roles
    help: str
    status: str = "built"  # built | planned

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this metric."""
        if self.kind is Kind.HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)

    @property
    def family(self) -> str:
        """The name in prometheus_client's registry (counters without ``_total``)."""
        return self.name.removesuffix("_total") if self.kind is Kind.COUNTER else self.name


def _m(name, kind, unit, labels, exporters, help, status="built"):  # type: ignore[no-untyped-def]
    if isinstance(exporters, str):
        exporters = frozenset({exporters})
    return MetricSpec(name, Kind(kind), unit, tuple(labels), frozenset(exporters), help, status)


H, C, G = "histogram", "counter", "gauge"
P = ("pipeline",)
R = ("role",)

ROUTER_METRICS = (
    _m("pdd_time_to_first_token_seconds", H, "seconds", P, ROUTER,
       "Request arrival to the first token from a worker."),
    _m("pdd_inter_token_latency_seconds", H, "seconds", P, ROUTER,
       "Time between successive token steps of a request."),
    _m("pdd_request_time_per_output_token_seconds", H, "seconds", P, ROUTER,
       "Per request: (E2E - TTFT) / (output tokens - 1); requests with 2+ output tokens."),
    _m("pdd_e2e_request_latency_seconds", H, "seconds", P, ROUTER, "Request arrival to finish."),
    _m("pdd_requests_total", C, "requests", ("finish_reason", "pipeline"), ROUTER,
       "Finished requests."),
    _m("pdd_sla_good_requests_total", C, "requests", P, ROUTER,
       "Finished requests (stop or length) within router.sla_ttft_s and router.sla_tpot_s."),
    _m("pdd_prompt_tokens_total", C, "tokens", P, ROUTER, "Prompt tokens of finished requests."),
    _m("pdd_generation_tokens_total", C, "tokens", P, ROUTER,
       "Tokens given to clients by finished requests."),
    _m("pdd_prompt_cached_tokens_total", C, "tokens", P, ROUTER,
       "Prompt tokens served from a worker's prefix cache."),
    _m("pdd_requests_rejected_total", C, "requests", ("reason",), ROUTER,
       "Requests refused before routing (overloaded, unavailable)."),
    _m("pdd_requests_in_flight", G, "requests", (), ROUTER, "Requests admitted, not finished."),
    _m("pdd_route_decisions_total", C, "requests", P, ROUTER,
       "Requests routed, by the pipeline chosen."),
    _m("pdd_handoffs_total", C, "handoffs", ("mode",), ROUTER,
       "Finished p_rld_md requests by handoff mode (one_shot, catch_up, rld_finished)."),
    _m("pdd_kv_deferred_total", C, "requests", (), ROUTER,
       "rld_finished requests whose KV to MD was left to land in the background (the next "
       "turn's prefix) instead of being cut."),
    _m("pdd_md_computed_total", C, "requests", P, ROUTER,
       "Requests whose MD computed the prompt blocks it lacked itself instead of receiving "
       "their KV (recompute or wait, a wait given up, no room for the KV)."),
    _m("pdd_handoff_rounds", H, "rounds", ("mode",), ROUTER,
       "MD Generate calls per handoff (Catch-Up warm-ups + the switch)."),
    _m("pdd_handoff_stall_seconds", H, "seconds", ("mode",), ROUTER,
       "Last RLD token to first MD token at a handoff switch."),
    _m("pdd_output_tokens_total", C, "tokens", ("tier",), ROUTER,
       "Output tokens given to clients, by the tier that produced them (p, rld, md, d, "
       "colocated)."),
    _m("pdd_wan_kv_bytes_total", C, "bytes", P, ROUTER,
       "KV bytes P queued for MD over the WAN, after P's codec (pd baselines: for D)."),
    _m("pdd_wan_kv_raw_bytes_total", C, "bytes", P, ROUTER,
       "The same KV before P's WAN codec (raw)."),
    _m("pdd_worker_healthy", G, "bool", ("worker", "role"), ROUTER,
       "1 if the worker's last health poll succeeded."),
    _m("pdd_worker_requests_in_flight", G, "requests", ("worker", "role"), ROUTER,
       "Requests this router has running on the worker."),
    _m("pdd_worker_restarts_total", C, "restarts", ("worker", "role"), ROUTER,
       "Times the worker came back as a new process (its Health instance id changed)."),
    _m("pdd_worker_cost_per_hour", G, "cost_per_hour", ("worker", "role"), ROUTER,
       "Configured hardware cost per hour of the worker (router.cost_per_hour of its role); "
       "one series per configured worker, so sum() is the fleet's cost."),
    _m("pdd_workers", G, "workers", R, ROUTER, "Workers of each role in the router's fleet."),
)  # fmt: skip

WORKER_METRICS = (
    _m("pdd_worker_ready", G, "bool", R, WORKERS, "1 when the engine serves."),
    _m("pdd_worker_running_requests", G, "requests", R, WORKERS, "Requests being generated."),
    _m("pdd_worker_waiting_requests", G, "requests", R, WORKERS,
       "Requests waiting for the scheduler (queue depth)."),
    _m("pdd_worker_kv_cache_usage_ratio", G, "ratio", R, WORKERS,
       "Fraction of the engine's KV blocks in use."),
    _m("pdd_worker_prefix_cache_queries_total", C, "tokens", R, WORKERS,
       "Prompt tokens looked up in the engine's prefix cache."),
    _m("pdd_worker_prefix_cache_hits_total", C, "tokens", R, WORKERS,
       "Prompt tokens found in the engine's prefix cache."),
    _m("pdd_worker_generation_tokens_total", C, "tokens", R, WORKERS,
       "Tokens the worker's engine generated."),
    _m("pdd_worker_requests_total", C, "requests", ("role", "outcome"), WORKERS,
       "Generate requests by how they ended."),
    _m("pdd_worker_kv_pinned_slots", G, "blocks", R, KV_WORKERS,
       "Arena/DRC slots pinned by requests or transfers."),
    _m("pdd_worker_kv_arena_blocks", G, "blocks", R, KV_WORKERS,
       "KV arena size (P: staging slots, RLD: landing slots, MD: DRC blocks)."),
    _m("pdd_worker_kv_free_blocks", G, "blocks", R, KV_WORKERS,
       "Arena blocks a new request can have now (MD: free + evictable + kept landings' "
       "slots); the router routes by it."),
    _m("pdd_worker_kv_open_transfers", G, "transfers", R, KV_WORKERS,
       "KV transfers (in + out) not yet terminal."),
    _m("pdd_worker_wan_bandwidth_bps", G, "bits_per_second", R, PREFILL,
       "P's live WAN bandwidth estimate toward MD."),
    _m("pdd_worker_wan_rtt_seconds", G, "seconds", R, PREFILL,
       "P's live WAN round-trip estimate toward MD."),
    _m("pdd_worker_kv_sent_bytes_total", C, "bytes", R, PREFILL, "KV bytes sent (acknowledged)."),
    _m("pdd_worker_kv_received_bytes_total", C, "bytes", R, {RELAY_DECODE, MAIN_DECODE},
       "KV bytes received."),
    _m("pdd_drc_capacity_blocks", G, "blocks", R, MAIN_DECODE, "Slots of the DRC host tier."),
    _m("pdd_drc_used_blocks", G, "blocks", R, MAIN_DECODE, "Blocks cached in the DRC."),
    _m("pdd_drc_landing_blocks", G, "blocks", R, MAIN_DECODE,
       "DRC slots reserved for blocks landing."),
    _m("pdd_drc_query_tokens_total", C, "tokens", R, MAIN_DECODE,
       "Prompt tokens looked up in the DRC (PrepareKv)."),
    _m("pdd_drc_hit_tokens_total", C, "tokens", R, MAIN_DECODE,
       "Of those, tokens the DRC held."),
    _m("pdd_drc_evicted_blocks_total", C, "blocks", R, MAIN_DECODE,
       "Blocks evicted from the DRC (LRU)."),
    # Per transport (ucx: P to RLD inside datacenter A; tcp: P to MD across the WAN).
    _m("pdd_kv_transfer_bytes_total", C, "bytes", ("role", "transport"), PREFILL,
       "KV bytes sent and acknowledged, by transport."),
    _m("pdd_kv_wire_bytes_total", C, "bytes", ("role", "transport"), PREFILL,
       "KV payload bytes put on the wire, after the WAN codec (raw transports: as acked)."),
    _m("pdd_kv_transfer_seconds", H, "seconds", ("role", "transport"), PREFILL,
       "Duration of each finished outbound KV transfer, by transport."),
    _m("pdd_worker_kv_refused_chunks_total", C, "chunks", R, {RELAY_DECODE, MAIN_DECODE},
       "Inbound KV chunks refused because their header describes other KV than this worker's "
       "geometry (dtype, block size, layout, heads, layers) or lack their reservation's landing "
       "key (not from the P the router chose); the request recomputes."),
    _m("pdd_worker_kv_in_waits_total", C, "requests", R, MAIN_DECODE,
       "Generate calls that found their inbound KV still on its way and waited for it (a "
       "request whose every block the DRC holds never does)."),
    _m("pdd_worker_own_blocks_stored_total", C, "blocks", R, MAIN_DECODE,
       "Blocks MD stored in its DRC after requests finished: the whole blocks of prompt + "
       "output it computed itself and the DRC lacked (what the next turn will not need over "
       "the WAN). The engine copies exactly these, straight into DRC landing slots."),
    _m("pdd_worker_md_sessions", G, "sessions", R, MAIN_DECODE,
       "Catch-Up sessions MD holds open (router.pdd.catch_up_sessions): requests whose KV stays "
       "in the engine between their warm-ups and the switch. Each ends with its switch, an "
       "Abort from the router, or worker.md_session_idle_s without a call."),
    _m("pdd_worker_md_session_turns_total", C, "requests", R, MAIN_DECODE,
       "Catch-Up calls (warm-ups after the first, the switch) that continued a session MD held "
       "open: they computed only the tokens RLD emitted since."),
    _m("pdd_worker_prompt_tokens_received_total", C, "tokens", ("role", "rpc"), WORKERS,
       "Prompt token ids received, by RPC (Generate, PrepareKv): a Generate that refers to "
       "its PrepareKv's prompt (prompt_ref) counts only the tokens after it, so over the WAN "
       "MD's Generate share stays near the emitted tokens."),
    _m("pdd_worker_prompt_refs_total", C, "requests", ("role", "outcome"),
       {RELAY_DECODE, MAIN_DECODE},
       "Generates that referred to a PrepareKv's prompt: resolved, or missing (no longer "
       "held; the router resent the prompt whole). Missing ones growing: see "
       "docs/operations.md."),
    _m("pdd_worker_kv_internal_errors_total", C, "transfers", R, {RELAY_DECODE, MAIN_DECODE},
       "Inbound KV transfers failed by a bug on this worker (logged with a traceback)."),
    _m("pdd_kv_transfers_total", C, "transfers", ("role", "transport", "outcome"), PREFILL,
       "Outbound KV transfers by transport and how they ended (done, failed, cancelled)."),
)  # fmt: skip


def _vllm(name, kind, unit, help):  # type: ignore[no-untyped-def]
    return _m(name, kind, unit, VLLM_LABELS, WORKERS, help)


# vLLM 0.32's own engine metrics (vllm/v1/metrics/loggers.py). Every worker has them (vLLM adds
# its PrometheusStatLogger next to pdd's stat sink, in the worker's default registry), but they
# are "planned" until Prometheus can read them: Prometheus asks for OpenMetrics, and
# prometheus_client 0.26 then writes the samples as vllm_* (colons escaped) under vllm:* HELP
# lines, so vllm:* series never exist in Prometheus. The worker's /metrics must answer in the
# classic text format (0.0.4) whatever the Accept header says.
VLLM_METRICS = (
    _vllm("vllm:num_requests_running", G, "requests", "vLLM: requests in model execution."),
    _vllm("vllm:num_requests_waiting", G, "requests", "vLLM: requests waiting."),
    _vllm("vllm:kv_cache_usage_perc", G, "ratio", "vLLM: KV-cache usage (1 = 100%)."),
    _vllm("vllm:prefix_cache_queries_total", C, "tokens", "vLLM: prefix-cache queries."),
    _vllm("vllm:prefix_cache_hits_total", C, "tokens", "vLLM: prefix-cache hits."),
    _vllm("vllm:prompt_tokens_total", C, "tokens", "vLLM: prefill tokens processed."),
    _vllm("vllm:generation_tokens_total", C, "tokens", "vLLM: generation tokens processed."),
    _vllm("vllm:time_to_first_token_seconds", H, "seconds", "vLLM: time to first token."),
    _vllm("vllm:inter_token_latency_seconds", H, "seconds", "vLLM: inter-token latency."),
)

CATALOG: tuple[MetricSpec, ...] = ROUTER_METRICS + WORKER_METRICS + VLLM_METRICS
_BY_NAME = {m.name: m for m in CATALOG}
assert len(_BY_NAME) == len(CATALOG), "duplicate metric names in the catalog"


def get(name: str) -> MetricSpec:
    """The entry of a metric or of one of its series (``..._bucket``); KeyError if none."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and base in _BY_NAME and _BY_NAME[base].kind is Kind.HISTOGRAM:
            return _BY_NAME[base]
    raise KeyError(name)


def exported_by(process: str, metrics: Iterable[MetricSpec] = CATALOG) -> list[MetricSpec]:
    """Entries ``process`` (router, or a worker role) exports."""
    return [m for m in metrics if process in m.exporters]


def planned() -> list[MetricSpec]:
    return [m for m in CATALOG if m.status == "planned"]
