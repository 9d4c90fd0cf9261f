"""Router section, with the PDD policy (``router.pdd``) as a nested group."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pdd.config.base import Section
from pdd.config.fleet import FleetConfig
from pdd.protocol import RouterMode


class PddPolicyConfig(Section):
    """Pipeline choice, handoff and KV-plane timing of router.mode pdd (and the pd baselines)."""

    ttft_budget_s: float = Field(
        1.0,
        gt=0,
        description="p_md when the WAN transfer of the blocks MD lacks is expected to take at "
        "most this (rtt + bytes*8/bandwidth); above it p_rld_md lets RLD hide the transfer.",
    )
    wan_bandwidth_bps: float = Field(
        1e9,
        gt=0,
        description="WAN bandwidth estimate (bits/s) used until P reports a measured one.",
    )
    wan_rtt_s: float = Field(
        0.02, ge=0, description="WAN round-trip estimate used until P reports a measured one."
    )
    md_recompute: bool = Field(
        True,
        description="Recompute or wait: MD computes the prompt blocks it lacks itself instead "
        "of waiting for their KV when its measured prefill (fixed + tokens / rate, measured by "
        "its engine at start and kept live) is sooner than the WAN transfer, and computes them "
        "while P prefills; the pipeline choice then weighs the "
        "sooner of the two against ttft_budget_s. Off: MD always waits for the WAN.",
    )
    md_recompute_max_tokens: int = Field(
        512,
        ge=1,
        description="The most prompt tokens MD computes itself for one request (md_recompute): "
        "a warm turn's new tail, not a cold prompt, whose prefill would stall MD's decode "
        "batch for as long as colocated serving does; above it MD waits for the KV (RLD "
        "streaming meanwhile), except on p_md when that wait would miss ttft_budget_s.",
    )
    stream_kv: bool = Field(
        True,
        description="Stream KV while P prefills: SendKv goes out as soon as the destinations "
        "answered PrepareKv, and P sends each prefill chunk's blocks as its forward ends (to "
        "RLD and MD alike), so the WAN transfer overlaps P's prefill. Off: P sends once its "
        "token is out (the older flow; for comparisons, or per request: "
        '"pdd": {"stream_kv": false}).',
    )
    catch_up_load_threshold: float = Field(
        0.5,
        ge=0,
        description="Handoff mode switch: One-Shot (frees RLD soonest) when the RLD's load "
        "(requests / max_num_seqs) is at or above this, else Catch-Up (smoother stream).",
    )
    catch_up_threshold_tokens: int = Field(
        64,
        gt=0,
        description="Catch-Up: MD warm-up rounds repeat until fewer than this many emitted "
        "tokens are still missing on MD; then the switch happens.",
    )
    max_catch_up_rounds: int = Field(
        8, gt=0, description="Catch-Up: switch after this many warm-up rounds regardless."
    )
    min_catch_up_rounds: int = Field(
        1,
        ge=0,
        description="Catch-Up: warm-up rounds run at least this many times when MD's KV "
        "crossed, however small the gap: the first warm-up loads the prompt's KV from MD's DRC "
        "into its engine while RLD still streams, and with catch_up_sessions MD keeps the "
        "request open, so the switch computes only the tokens RLD emitted since (on the lab: "
        "the gap at the switch 146 ms against 258 ms with 0). 0: switch at once when the gap "
        "is under catch_up_threshold_tokens.",
    )
    catch_up_sessions: bool = Field(
        True,
        description="Catch-Up: MD keeps a request open between its warm-ups and the switch "
        "(the engine holds its KV, the last partly filled block included), so each later "
        "call computes only the tokens RLD emitted since; off: each call is a request of its "
        "own that finds whole blocks in MD's prefix cache and recomputes the rest.",
    )
    await_kv_poll_s: float = Field(
        1.0, gt=0, description="Timeout of one AwaitKv call (the router polls until done)."
    )
    await_kv_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Longest wait for MD's KV to land; then MD continues anyway and "
        "recomputes what is missing.",
    )
    kv_lease_s: float = Field(
        120.0,
        gt=0,
        description="Lease of the landing slots PrepareKv reserves (released earlier by "
        "landing+use or CancelKv; the lease is the backstop for a lost router).",
    )
    send_kv_deadline_s: float = Field(
        120.0, gt=0, description="Deadline P gives each KV send (SendKv.deadline_s)."
    )
    kv_in_wait_s: float = Field(
        30.0,
        gt=0,
        description="How long RLD/MD wait inside Generate for inbound KV before recomputing "
        "it (KvIn.wait_s).",
    )
    md_load_weight: float = Field(
        0.5,
        ge=0,
        description="MD score = prompt hit fraction in its DRC - md_load_weight * its load "
        "fraction (requests / max_num_seqs); the highest score wins (pdd.router.decide.policy).",
    )
    p_load_weight: float = Field(
        0.25,
        ge=0,
        description="P score = prompt hit fraction in the router's view of its prefix cache "
        "- p_load_weight * its requests in flight; the highest score wins.",
    )
    routed_prefix_blocks: int = Field(
        16384,
        ge=0,
        description="Per P and per MD, how many block hashes of the prompts routed there the "
        "router remembers (LRU): its view of P's prefix cache, and of MD's newest DRC blocks "
        "until the DRC replica catches up. 0: off (no P prefix affinity).",
    )
    test_policy: Literal["pdd", "p_rld_only"] = Field(
        "pdd",
        description="TEST ONLY. p_rld_only routes every request P -> RLD, RLD emits every "
        "token and MD never sees it (the excluded P-RLD pipeline, to demonstrate the drift "
        "it causes). Never set it in production.",
    )

    @model_validator(mode="after")
    def _poll_within_timeout(self) -> PddPolicyConfig:
        if self.await_kv_poll_s > self.await_kv_timeout_s:
            raise ValueError("await_kv_poll_s must not exceed await_kv_timeout_s")
        return self


class CostPerHourConfig(Section):
    """Hardware cost per hour of one worker of each kind, for BCR (SLA goodput per cost).

    Any money unit; only ratios matter when comparing systems. The defaults price MD's chip
    (GPU type B) 25% above P's and RLD's (GPU type A), as in the PDD report."""

    prefill: float = Field(1.0, ge=0, description="Cost per hour of one prefill worker.")
    relay_decode: float = Field(1.0, ge=0, description="Cost per hour of one relay_decode worker.")
    main_decode: float = Field(1.25, ge=0, description="Cost per hour of one main_decode worker.")
    colocated: float = Field(1.0, ge=0, description="Cost per hour of one colocated worker.")


class RouterConfig(Section):
    host: str = Field("127.0.0.1", description="Address the OpenAI-compatible API binds to.")
    port: int = Field(8000, ge=0, lt=65536, description="HTTP port; 0 picks a free port.")
    mode: RouterMode = Field(
        RouterMode.COLOCATED,
        description="Serving flow: colocated | pd_local | pd_wan | pdd (baselines share code).",
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest accepted request body (413 above)."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Deadline for one request end to end."
    )
    worker_rpc_timeout_s: float = Field(
        5.0, gt=0, description="Deadline for control RPCs (health, stats, abort) to workers."
    )
    health_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often the router polls each worker's health (and, in mode pdd, "
        "each MainDecode's DRC events).",
    )
    health_missed_polls: int = Field(
        3,
        ge=1,
        description="Consecutive Health/Stats timeouts before a healthy worker counts as "
        "unhealthy (a worker on a saturated host answers late). A refused connection, an "
        "error or a not-ready answer counts at once.",
    )
    max_queued_requests: int = Field(
        256, gt=0, description="Requests admitted but not yet finished; 429 above."
    )
    log_requests: bool = Field(False, description="Log one line per finished request.")
    drain_timeout_s: float = Field(
        20.0,
        ge=0,
        description="On SIGTERM the router answers new requests 503 (Retry-After) and lets "
        "open requests and streams finish for up to this long, then stops.",
    )
    sla_ttft_s: float = Field(
        5.0,
        gt=0,
        description="SLA limit on time to first token; a finished request within this and "
        "sla_tpot_s counts in pdd_sla_good_requests_total (SLA goodput).",
    )
    sla_tpot_s: float = Field(
        0.1,
        gt=0,
        description="SLA limit on time per output token, (E2E - TTFT) / (output tokens - 1); "
        "requests with one output token meet it by definition.",
    )
    cost_per_hour: CostPerHourConfig = Field(
        default_factory=CostPerHourConfig,
        description="Cost per hour of each worker kind (exported as pdd_worker_cost_per_hour "
        "for BCR).",
    )
    debug_requests: int = Field(
        256,
        ge=0,
        description="How many recent requests /debug/requests/{id} keeps (route, timeline, "
        "outcome); 0 keeps none.",
    )
    api_keys_file: Path | None = Field(
        None,
        description="File of accepted API keys (one per line, `#` starts a comment); every "
        "request but /health, /openapi.json (and /metrics) then needs `Authorization: Bearer "
        "KEY`. Re-read when it changes and on SIGHUP. null: no file; the PDD_API_KEY "
        "environment variable also enables a key; with neither, no authentication.",
    )
    metrics_require_key: bool = Field(
        False, description="With authentication on, /metrics needs an API key too."
    )
    pdd: PddPolicyConfig = Field(
        default_factory=PddPolicyConfig,
        description="PDD policy: pipeline choice, handoff, KV-plane timing (modes pdd, pd_*).",
    )
    fleet: FleetConfig = Field(
        default_factory=FleetConfig,
        description="Workers joining at run time: registration and DNS discovery.",
    )
