"""The benchmark's configuration: workloads, load, SLA, costs and the modes to compare.

Typed, frozen pydantic sections (unknown keys rejected) loaded from YAML (``configs/bench/``)
with ``--set a.b=c`` overrides, like every pdd config. ``SHORT_PROFILE`` is the set of
overrides ``--short`` applies before the user's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pdd.config import apply_overrides, read_yaml_mapping
from pdd.config.base import Section
from pdd.errors import ConfigError
from pdd.protocol import Role

WorkloadName = Literal["agentic", "sweep", "trace", "turns"]


class HitClass(Section):
    """A share of requests whose prefix hit rate is drawn uniformly from [low, high]."""

    weight: float = Field(..., gt=0, description="Relative share of requests in this class.")
    low: float = Field(..., ge=0, le=1, description="Lowest hit rate of the class.")
    high: float = Field(..., ge=0, le=1, description="Highest hit rate of the class.")

    @model_validator(mode="after")
    def _ordered(self) -> HitClass:
        if self.low > self.high:
            raise ValueError(f"low {self.low} is above high {self.high}")
        return self


def _default_classes() -> list[HitClass]:
    # About 3/4 of requests above 95% hit, a tail of low-hit ones, about 90% on average.
    return [
        HitClass(weight=0.77, low=0.95, high=0.995),
        HitClass(weight=0.18, low=0.7, high=0.95),
        HitClass(weight=0.05, low=0.0, high=0.5),
    ]


class AgenticConfig(Section):
    """Multi-turn agent conversations that grow by tool-call turns (PDD-FACTS' traffic)."""

    requests: int = Field(200, gt=0, description="Measured requests.")
    conversations: int = Field(
        16, gt=0, description="Live conversations; each starts with one warm-up request."
    )
    prompt_tokens_min: int = Field(1024, gt=0, description="Shortest prompt, in tokens.")
    prompt_tokens_max: int = Field(6144, gt=0, description="Longest prompt, in tokens.")
    output_tokens_min: int = Field(32, gt=0, description="Shortest answer (log-uniform).")
    output_tokens_max: int = Field(256, gt=0, description="Longest answer (log-uniform).")
    hit_classes: list[HitClass] = Field(
        default_factory=_default_classes,
        min_length=1,
        description="Target prefix-hit distribution of measured requests.",
    )
    anomaly_share: float = Field(
        0.03, ge=0, le=1, description="Share of long-input/short-output requests (low hit)."
    )
    anomaly_output_tokens: int = Field(8, gt=0, description="Answer length of an anomaly.")

    @model_validator(mode="after")
    def _ranges(self) -> AgenticConfig:
        if self.prompt_tokens_min > self.prompt_tokens_max:
            raise ValueError("prompt_tokens_min is above prompt_tokens_max")
        if self.output_tokens_min > self.output_tokens_max:
            raise ValueError("output_tokens_min is above output_tokens_max")
        return self


class SweepConfig(Section):
    """Fixed hit-rate buckets for the bathtub curve; each bucket runs as its own phase."""

    buckets: list[float] = Field(
        default_factory=lambda: [round(0.1 * i, 1) for i in range(11)],
        min_length=1,
        description="Hit rates; a request of hit h shares h * prompt_tokens with a warm one.",
    )
    requests_per_bucket: int = Field(8, gt=0, description="Measured requests per bucket.")
    prompt_tokens: int = Field(4096, gt=0, description="Prompt length of every request.")
    output_tokens: int = Field(64, gt=0, description="Answer length of every request.")

    @model_validator(mode="after")
    def _buckets(self) -> SweepConfig:
        bad = [b for b in self.buckets if not 0 <= b <= 1]
        if bad:
            raise ValueError(f"buckets must lie in [0, 1], got {bad}")
        if len(set(self.buckets)) != len(self.buckets):
            raise ValueError(f"buckets must differ, got {self.buckets}")
        return self


class TurnsConfig(Section):
    """Cold prompts and their next turns, per size: the whole stream of each (turns.py)."""

    sizes: list[int] = Field(
        default_factory=lambda: [512, 1500, 3000], min_length=1,
        description="Prompt tokens of the cold requests, one pair of groups each.",
    )  # fmt: skip
    rounds: int = Field(3, gt=0, description="Cold requests (and their next turns) per size.")
    output_tokens: int = Field(64, gt=0, description="max_tokens of every request.")
    new_tokens: int = Field(
        64, ge=24, description="Tokens a next turn adds: a tool call and its result."
    )

    @field_validator("sizes")
    @classmethod
    def _sizes(cls, v: list[int]) -> list[int]:
        if min(v) < 64 or len(set(v)) != len(v):
            raise ValueError(f"turns.sizes must be distinct sizes of at least 64 tokens: {v}")
        return v


class TraceConfig(Section):
    """Replay of a JSONL trace: timestamp, conversation_id, messages or prompt, max_tokens."""

    path: Path | None = Field(None, description="The JSONL file (required for workload trace).")
    speed: float = Field(1.0, gt=0, description="Time scale: 2 replays twice as fast.")
    max_requests: int | None = Field(None, gt=0, description="Replay only the first N lines.")
    warmup_requests: int = Field(0, ge=0, description="Leading requests left out of metrics.")
    wait_for_previous_turn: bool = Field(
        True, description="A turn is sent only after its conversation's previous turn ended."
    )


class LoadConfig(Section):
    """How requests are offered. The trace workload always replays its own timestamps."""

    pattern: Literal["open", "closed"] = Field(
        "closed", description="open: Poisson arrivals at `rate`; closed: `concurrency` streams."
    )
    rate: float = Field(1.0, gt=0, description="Open loop: mean arrivals per second.")
    concurrency: int = Field(8, gt=0, description="Closed loop (and warm-up): parallel streams.")
    duration_s: float = Field(
        600.0, gt=0, description="No new request is sent after this long in one phase."
    )
    request_timeout_s: float = Field(300.0, gt=0, description="Deadline of one request.")
    max_in_flight: int = Field(256, gt=0, description="Open loop: cap on concurrent requests.")


class SlaConfig(Section):
    ttft_s: float = Field(2.0, gt=0, description="A request within SLA has TTFT at most this.")
    tpot_s: float = Field(0.1, gt=0, description="... and TPOT at most this (s per token).")


def _default_prices() -> dict[str, float]:
    return {"gpu_a": 2.0, "gpu_b": 2.5}


def _default_role_kinds() -> dict[Role, str]:
    return {
        Role.COLOCATED: "gpu_a",
        Role.PREFILL: "gpu_a",
        Role.RELAY_DECODE: "gpu_a",
        Role.MAIN_DECODE: "gpu_b",
    }


class CostConfig(Section):
    """Hardware cost, for BCR = SLA goodput / cost per hour."""

    per_hour: dict[str, float] = Field(
        default_factory=_default_prices, description="Cost per hour of one worker of each kind."
    )
    role_kind: dict[Role, str] = Field(
        default_factory=_default_role_kinds,
        description="Worker kind of each role (to count a started topology's workers).",
    )


class ModeConfig(Section):
    """One system under test: a running endpoint, or a topology started with `pdd serve`."""

    name: str = Field(
        ..., min_length=1, description="colocated | pd_local | pd_wan | pdd | vllm_nixl | ..."
    )
    url: str | None = Field(None, description="Base URL of a running OpenAI-compatible server.")
    config: Path | None = Field(None, description="Topology YAML started with `pdd serve`.")
    server: Literal["pdd", "vllm_nixl"] = Field(
        "pdd",
        description="What serves a `config` mode: pdd (`pdd serve` of the topology), or "
        "vllm_nixl: vLLM's own P/D flow on the topology's first prefill and first main_decode "
        "worker (their engine settings and sites, the lab included): `vllm serve` as P and as "
        "D with its NixlConnector, D pulling only the blocks its prefix cache lacks, behind "
        "vLLM's proxy flow (pdd.bench.serve.nixl_proxy) next to P.",
    )
    nixl_progress_delay_us: int = Field(
        100,
        ge=0,
        description="vllm_nixl: microseconds NIXL's progress threads sleep between polls "
        "(pdd.bench.serve.nixl_progress); 0: NIXL's own busy poll, a core per process.",
    )
    overrides: list[str] = Field(default_factory=list, description="`--set` for `pdd serve`.")
    workers: dict[str, int] = Field(
        default_factory=dict,
        description="Workers of each kind (for cost). Empty: counted from the topology's roles.",
    )
    api_key: bool = Field(
        False,
        description="Serve the mode with client authentication on: a throwaway API key in a "
        "keys file in the results folder (`router.api_keys_file`), sent on every request "
        "(a `config` mode only).",
    )

    @model_validator(mode="after")
    def _one_target(self) -> ModeConfig:
        if (self.url is None) == (self.config is None):
            raise ValueError(f"mode {self.name!r}: give exactly one of url and config")
        if self.api_key and (self.config is None or self.server != "pdd"):
            raise ValueError(f"mode {self.name!r}: api_key needs a config (pdd serve) mode")
        if self.server != "pdd" and self.config is None:
            raise ValueError(f"mode {self.name!r}: server {self.server} needs a config")
        return self


class CompareConfig(Section):
    """The headline comparison: ``candidate`` against ``baseline`` on one workload, with the
    targets of issue #5 (PDD-FACTS: -51.5% P90 TTFT, up to 10x fewer WAN bytes, +27.8%
    goodput, 6.2% of tokens from RLD)."""

    baseline: str = Field("pd_wan", description="Mode the candidate is measured against.")
    candidate: str = Field("pdd", description="Mode under test.")
    workload: WorkloadName = Field("agentic", description="Workload the comparison reads.")
    ttft_p90_reduction: float = Field(0.5, description="Target: 1 - P90 cand/base at least.")
    ttft_p99_reduction: float = Field(0.5, description="Target: 1 - P99 cand/base at least.")
    wan_bytes_factor: float = Field(5.0, description="Target: base/cand WAN bytes at least.")
    goodput_gain: float = Field(0.2, description="Target: cand/base SLA goodput - 1 at least.")
    rld_share_max: float = Field(0.15, description="Target: RLD share of output tokens below.")


class BenchConfig(Section):
    """`pdd bench serve`: which workloads run against which modes, and how they are judged."""

    seed: int = Field(0, description="Seed of every generator: same seed, same requests.")
    workloads: list[WorkloadName] = Field(
        default_factory=lambda: ["agentic", "sweep"], min_length=1, description="Run in order."
    )
    modes: list[ModeConfig] = Field(
        default_factory=lambda: [
            ModeConfig(name="colocated", config=Path("configs/colocated.yaml"))
        ],
        min_length=1,
        description="Systems to compare, run one after another.",
    )
    agentic: AgenticConfig = Field(default_factory=AgenticConfig, description="Agentic.")
    sweep: SweepConfig = Field(default_factory=SweepConfig, description="Hit-rate sweep.")
    trace: TraceConfig = Field(default_factory=TraceConfig, description="Trace replay.")
    turns: TurnsConfig = Field(default_factory=TurnsConfig, description="Cold and next turns.")
    load: LoadConfig = Field(default_factory=LoadConfig, description="Arrivals.")
    sla: SlaConfig = Field(default_factory=SlaConfig, description="SLA limits.")
    cost: CostConfig = Field(default_factory=CostConfig, description="Hardware cost.")
    tokenizer: Literal["auto", "model", "estimate"] = Field(
        "auto", description="auto: the model's tokenizer.json when prepared, else estimate."
    )
    tokens_per_word: float = Field(1.3, ge=1, description="Estimator's tokens per word.")
    model: str | None = Field(None, description="Model name in requests. Null: /v1/models.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of every request.")
    ignore_eos: bool = Field(True, description="Answers run to max_tokens (vLLM extension).")
    serve_ready_timeout_s: float = Field(600.0, gt=0, description="Wait for `pdd ready`.")
    results_dir: Path = Field(Path("results/bench-serve"), description="Parent of run folders.")
    progress_interval_s: float = Field(5.0, gt=0, description="Seconds between progress lines.")
    lab_prefix: str | None = Field(
        None,
        description="Meter bytes on this lab's WAN per measured phase (the lab must stay up "
        "for the whole run: bring it up before, so `pdd serve` leaves it up).",
    )
    compare: CompareConfig = Field(
        default_factory=CompareConfig, description="Headline comparison (when both modes ran)."
    )
    timelines: bool = Field(
        False,
        description="After each request, keep the router's /debug/requests/{id} view in "
        "requests.jsonl (`debug`: route, each RPC and each worker's first token): where the "
        "time went. Needs router.debug_requests > 0; servers without the view record null.",
    )

    @model_validator(mode="after")
    def _checks(self) -> BenchConfig:
        names = [m.name for m in self.modes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate mode names: {dup}")
        if "trace" in self.workloads and self.trace.path is None:
            raise ValueError("workload trace needs trace.path")
        return self

    def mode(self, name: str) -> ModeConfig:
        for m in self.modes:
            if m.name == name:
                return m
        raise ConfigError(f"no mode {name!r} (have {[m.name for m in self.modes]})")


# `--short`: a smoke run of a minute or so per mode on 2 CPU cores (what `make test` runs
# against configs/bench/local.yaml's pd_wan and pdd modes).
SHORT_PROFILE: list[str] = [
    "agentic.requests=12",
    "agentic.conversations=3",
    "agentic.prompt_tokens_min=256",
    "agentic.prompt_tokens_max=1024",
    "agentic.output_tokens_min=8",
    "agentic.output_tokens_max=24",
    "agentic.anomaly_share=0.1",
    "sweep.buckets=[0.0,0.9,1.0]",
    "sweep.requests_per_bucket=2",
    "sweep.prompt_tokens=768",
    "sweep.output_tokens=16",
    "load.pattern=closed",
    "load.concurrency=4",
    "load.duration_s=300",  # a safety bound, far above what the profile needs
    "load.request_timeout_s=300",
    "lab_prefix=null",
    "progress_interval_s=10",
]


def load_bench_config(
    path: str | Path | None = None, overrides: list[str] | None = None, short: bool = False
) -> BenchConfig:
    """Load YAML (defaults when None), apply ``--short`` then ``overrides``; raise ConfigError."""
    data = read_yaml_mapping(path, "benchmark config") if path is not None else {}
    data = apply_overrides(data, (SHORT_PROFILE if short else []) + list(overrides or []))
    try:
        return BenchConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e["loc"]) or "<root>"
            lines.append(
                f"  {where}: {'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}"
            )
        raise ConfigError("invalid benchmark config:\n" + "\n".join(lines)) from None
