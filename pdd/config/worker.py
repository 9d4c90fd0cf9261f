"""Worker entries: one per process in the topology."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdd.config.base import Section
from pdd.config.faults import FaultsConfig
from pdd.config.model import EngineConfig
from pdd.protocol import Role

GIB = 1 << 30


class WorkerConfig(Section):
    id: str = Field(..., min_length=1, description="Instance id, unique in the topology.")
    role: Role = Field(..., description="colocated | prefill | relay_decode | main_decode.")
    host: str = Field("127.0.0.1", description="Address the worker's gRPC server binds to.")
    port: int = Field(0, ge=0, lt=65536, description="gRPC port; 0 picks a free port.")
    metrics_port: int = Field(
        0,
        ge=0,
        lt=65536,
        description="Prometheus /metrics (and /health, for probes) HTTP port; 0 picks a free port.",
    )
    datacenter: str = Field("dc-a", description="Datacenter the worker runs in (lab namespace).")
    engine: EngineConfig | None = Field(
        None, description="Engine settings for this worker; null uses the top-level `engine`."
    )
    max_queued_requests: int = Field(
        64,
        ge=0,
        description="Generate requests waiting beyond the engine's max_num_seqs; one more is "
        "refused with RESOURCE_EXHAUSTED (the router answers 429 with Retry-After).",
    )
    drain_timeout_s: float = Field(
        20.0,
        ge=0,
        description="On SIGTERM the worker refuses new work (UNAVAILABLE, Health not ready) "
        "and lets requests in flight finish for up to this long, then aborts the rest.",
    )
    # --- KV plane (prefill, relay_decode, main_decode) --------------------------------------
    kv_port: int = Field(
        0,
        ge=0,
        lt=65536,
        description="Port of this worker's KV receiver (relay_decode: UCX listener, "
        "main_decode: TCP listener), bound on `host`; 0 picks a free port.",
    )
    kv_advertise_host: str | None = Field(
        None,
        description="Address peers dial to reach this worker's KV receiver (PrepareKv "
        "answers it). Null or `auto`: `host`. Required when `host` is a wildcard.",
    )
    kv_transport: Literal["ucx", "tcp", "inproc"] | None = Field(
        None,
        description="Transport of this worker's KV receiver. Null: the role's default "
        "(relay_decode: ucx, main_decode: tcp).",
    )
    kv_staging_gib: float = Field(
        0.5,
        gt=0,
        description="Shared-memory staging arena of prefill (prompt blocks waiting to be "
        "sent) and relay_decode (blocks landed for a request), in GiB; a request that "
        "does not fit is refused (RESOURCE_EXHAUSTED). main_decode uses cache.host_capacity_gib.",
    )
    kv_stage_lease_s: float = Field(
        60.0,
        gt=0,
        description="Prefill: staged blocks are released this long after staging if no "
        "SendKv came (and open sends cancelled once it passed).",
    )
    kv_landing_lease_s: float = Field(
        60.0,
        gt=0,
        description="relay_decode / main_decode: landing slots and reservations of a request "
        "are released after this when nothing consumed or cancelled them (PrepareKv's "
        "lease_s overrides it per request).",
    )
    kv_fence_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Slots of an aborted request are freed once the engine confirms it is "
        "done with them; after this long without that confirmation the engine counts as "
        "stalled: the worker reports not ready and the slots stay held (never reused) until "
        "the engine confirms or its process is gone.",
    )
    md_session_idle_s: float = Field(
        20.0,
        gt=0,
        description="main_decode: a Catch-Up request MD keeps open between its warm-ups and "
        "the switch (router.pdd.catch_up_sessions; its KV stays in the engine) is ended after "
        "this long without its next call.",
    )
    kv_store_own_blocks: bool = Field(
        True,
        description="main_decode: after a request finishes, store the whole blocks of its "
        "prompt + output that the DRC lacks (blocks MD computed itself), so the next turn of "
        "the conversation needs none of them over the WAN.",
    )

    # --- fleet registration (router.fleet.accept_registrations) ------------------------------
    register_url: str | None = Field(
        None,
        description="Router base URL (e.g. http://router:8000) this worker registers with and "
        "heartbeats to (`--register URL` sets it); null: the router's config lists it.",
    )
    register_interval_s: float = Field(
        2.0, gt=0, description="Heartbeat period of a registered worker."
    )
    advertise_host: str | None = Field(
        None,
        description="Address the router dials for this worker's gRPC when it registers; "
        "null: `host` (required when `host` is a wildcard).",
    )

    faults: FaultsConfig = Field(
        default_factory=FaultsConfig,
        description="Fault injection for tests (pdd/config/faults.py); off by default.",
    )

    def staging_slots(self, block_bytes: int) -> int:
        """How many KV blocks of ``block_bytes`` the staging arena holds."""
        return max(1, int(self.kv_staging_gib * GIB) // block_bytes)
