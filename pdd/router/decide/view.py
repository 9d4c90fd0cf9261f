"""The snapshot routing policy reads, and the decision it returns (plain frozen data).

    FleetView (workers: health, load, KV-plane stats; the policy config)
    RouteRequest (prompt size, per-MD cached tokens, per-request overrides)
        --choose()--> Decision (pipeline, worker per role, handoff mode, WAN estimate)

The pool builds ``FleetView``s and the service builds ``RouteRequest``s; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdd.config.router import PddPolicyConfig
from pdd.kv_geometry import RECEIVER_CONVERTS, KvGeometry, describe_conflict, pair_conflict
from pdd.protocol import HandoffMode, Pipeline, Role, RouterMode


@dataclass(frozen=True, slots=True)
class WanLinkView:
    """P's link to one receiver, from P's last Stats."""

    bandwidth_bps: float  # 0.0: not measured yet
    rtt_s: float
    queued_bytes: int = 0  # open transfers' bytes not yet acknowledged (deferred ones not)


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router last saw it (config plus its last Stats)."""

    id: str
    role: Role
    healthy: bool
    in_flight: int = 0  # requests this router has running on the worker right now
    running: int = 0  # from the worker's last Stats (all routers)
    waiting: int = 0
    kv_cache_usage: float = 0.0
    datacenter: str = ""
    max_num_seqs: int = 0  # 0: unknown
    block_size: int = 0  # tokens per KV block (0: not reported)
    kv_block_bytes: int = 0  # bytes of one block across all layers (0: not reported)
    wan_bandwidth_bps: float = 0.0  # P: live estimate toward its best-measured receiver (0: none)
    wan_rtt_s: float = 0.0
    wan_links: tuple[tuple[str, WanLinkView], ...] = ()  # P: per receiver id (WarmKv measures)
    wan_wire_ratio: float = 0.0  # P: learned wire/raw ratio of its WAN codec (0: unknown = raw)
    prefill_tokens_per_s: float = 0.0  # MD: its engine's measured prefill rate (0: unknown)
    prefill_fixed_s: float = 0.0  # MD: a prefill's cost beyond its tokens
    served: int = 0  # requests this router has given the worker so far (balances ties)
    source: str = "config"  # config | registered | dns:NAME
    restarts: int = 0  # times the router saw the worker come back as a new process
    geometry: KvGeometry | None = None  # its KV geometry (None: not reported)
    kv_arena_blocks: int = 0  # its KV arena (P: staging, RLD: landing, MD: DRC; 0: unknown)
    kv_free_blocks: int = 0  # of those, what a new request could have at its last Stats

    def link_to(self, worker_id: str) -> WanLinkView | None:
        """P's link to receiver ``worker_id``, if it reported one."""
        for peer, link in self.wan_links:
            if peer == worker_id:
                return link
        return None

    @property
    def free_slots(self) -> float:
        """Sequences it can still take (infinite when the capacity is unknown)."""
        return self.max_num_seqs - self.load if self.max_num_seqs > 0 else float("inf")

    @property
    def load(self) -> int:
        """Requests on the worker: this router's live count, or the worker's own if higher."""
        busy = self.running + self.waiting  # max() without the call: this is hot in choose
        return self.in_flight if self.in_flight >= busy else busy

    @property
    def load_fraction(self) -> float:
        """load / max_num_seqs (0 when the capacity is unknown)."""
        return self.load / self.max_num_seqs if self.max_num_seqs > 0 else 0.0

    def fits(self, tokens: int) -> bool:
        """Room in its KV arena for ``tokens``' whole blocks at its last Stats (always, when it
        reported no arena). Stats lag by up to one poll: the worker's own refusal backs this."""
        if self.kv_arena_blocks <= 0 or self.block_size <= 0:
            return True
        return tokens // self.block_size <= self.kv_free_blocks

    @property
    def has_capacity(self) -> bool:
        """Room for one more sequence (always, when the capacity is unknown)."""
        return self.max_num_seqs <= 0 or self.load < self.max_num_seqs


@dataclass(frozen=True, slots=True)
class FleetView:
    mode: RouterMode
    workers: tuple[WorkerView, ...]
    policy: PddPolicyConfig = field(default_factory=PddPolicyConfig)

    def healthy(self, *roles: Role) -> list[WorkerView]:
        return [w for w in self.workers if w.healthy and w.role in roles]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What policy may look at for one request.

    ``md_cached_tokens``: per MainDecode id, prompt tokens its DRC holds (router's replica).
    ``md_routed_tokens``: per MainDecode id, prompt tokens of the prefix the router recently
    routed there (affinity only: the replica lags by up to one health poll).
    ``p_cached_tokens``: per Prefill id, prompt tokens the router last saw it prefill (its
    view of P's prefix cache, ``pdd.router.fleet.routed_prefixes``).
    ``pipeline`` / ``handoff``: the request's override (None: the policy decides).
    """

    prompt_tokens: int
    max_tokens: int
    md_cached_tokens: Mapping[str, int] = field(default_factory=dict)
    p_cached_tokens: Mapping[str, int] = field(default_factory=dict)
    md_routed_tokens: Mapping[str, int] = field(default_factory=dict)
    pipeline: Pipeline | None = None
    handoff: HandoffMode | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The pipeline to run, the worker for each role it uses, and why.

    ``md_cached_tokens``, ``wan_bytes``, ``eta_s``: the policy's estimate (pdd/pd modes);
    ``eta_s`` is when MD can start: its KV landed, or (``md_computes``) computed by MD.
    """

    pipeline: Pipeline
    assignments: tuple[tuple[Role, str], ...]
    handoff: HandoffMode = HandoffMode.NONE
    md_cached_tokens: int = 0
    wan_bytes: int = 0
    eta_s: float = 0.0
    block_size: int = 0  # tokens per KV block as P reported it (0: unknown)
    relay_only: bool = False  # TEST ONLY (p_rld_only): the pd driver's D is an RLD doing MD's job
    md_computes: bool = False  # p_md: MD computes the blocks it lacks (sooner than the WAN)

    def worker(self, role: Role) -> str:
        worker_id = self.maybe_worker(role)
        if worker_id is None:
            raise KeyError(f"decision for {self.pipeline.value} has no {role.value} worker")
        return worker_id

    def maybe_worker(self, role: Role) -> str | None:
        for r, worker_id in self.assignments:
            if r is role:
                return worker_id
        return None

    @property
    def decoder(self) -> str:
        """The worker that decodes last: MD, or the baselines' D (any non-prefill role)."""
        md = self.maybe_worker(Role.MAIN_DECODE)
        if md is not None:
            return md
        return next(wid for r, wid in self.assignments if r is not Role.PREFILL)


def kv_conflict(sender: WorkerView, receiver: WorkerView) -> str | None:
    """Why ``sender``'s KV cannot land on ``receiver`` (one sentence naming both workers and
    the field), or None. Workers that report no geometry count as compatible; the receiver
    converts what its role converts on landing (``RECEIVER_CONVERTS``)."""
    if sender.geometry is None or receiver.geometry is None:
        return None
    converts = RECEIVER_CONVERTS.get(receiver.role, frozenset())
    field = pair_conflict(sender.geometry, receiver.geometry, converts)
    if field is None:
        return None
    return describe_conflict(field, sender.id, sender.geometry, receiver.id, receiver.geometry)


def least_loaded(candidates: list[WorkerView]) -> WorkerView | None:
    """Lowest load; ties by KV cache usage, then the fewest served so far (idle workers take
    turns), then by id (deterministic)."""
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.load, w.kv_cache_usage, w.served, w.id))
