"""Worker entries: one per process in the topology."""

from __future__ import annotations

from pydantic import Field

from pdd.config.base import Section
from pdd.config.model import EngineConfig
from pdd.protocol import Role


class WorkerConfig(Section):
    id: str = Field(..., min_length=1, description="Instance id, unique in the topology.")
    role: Role = Field(..., description="colocated | prefill | relay_decode | main_decode.")
    host: str = Field("127.0.0.1", description="Address the worker's gRPC server binds to.")
    port: int = Field(0, ge=0, lt=65536, description="gRPC port; 0 picks a free port.")
    metrics_port: int = Field(
        0, ge=0, lt=65536, description="Prometheus /metrics HTTP port; 0 picks a free port."
    )
    datacenter: str = Field("dc-a", description="Datacenter the worker runs in (lab namespace).")
    engine: EngineConfig | None = Field(
        None, description="Engine settings for this worker; null uses the top-level `engine`."
    )
