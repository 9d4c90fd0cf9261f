"""Typed messages of fleet registration (worker -> router HTTP, ``/internal/v1/workers``).

A worker started with ``--register URL`` POSTs a ``WorkerRegistration`` every
``register_interval_s`` (the first one admits it, the next ones are heartbeats) and DELETEs
its id when it stops; the router answers ``RegistrationReply``. Shared by ``pdd.worker``
(the client) and ``pdd.router`` (the endpoint), so it lives below both. No I/O here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdd.kv_geometry import KvGeometry
from pdd.protocol import Role

REGISTRATION_PATH = "/internal/v1/workers"
# With security.worker_token_file set, registering workers prove the fleet's token here.
WORKER_TOKEN_HEADER = "X-Pdd-Worker-Token"


class WorkerRegistration(BaseModel):
    """A worker announcing itself (or heartbeating): where the router reaches its gRPC."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")
    role: Role
    host: str = Field(..., min_length=1, max_length=255)
    port: int = Field(..., gt=0, lt=65536)
    datacenter: str = Field("dc-a", min_length=1, max_length=64)
    metrics_port: int = Field(0, ge=0, lt=65536)
    max_num_seqs: int = Field(0, ge=0, description="The engine's; 0: learn it from Stats.")
    geometry: KvGeometry | None = Field(
        None, description="The worker's KV geometry; one of another model is not admitted."
    )


class RegistrationReply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    status: Literal["added", "updated", "unchanged"]
    heartbeat_timeout_s: float
