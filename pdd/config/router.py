"""Router section."""

from __future__ import annotations

from pydantic import Field

from pdd.config.base import Section
from pdd.protocol import RouterMode


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
        1.0, gt=0, description="How often the router polls each worker's health."
    )
    max_queued_requests: int = Field(
        256, gt=0, description="Requests admitted but not yet finished; 429 above."
    )
    log_requests: bool = Field(False, description="Log one line per finished request.")
