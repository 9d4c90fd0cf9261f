"""Fleet membership (``router.fleet``): workers that join the router at run time.

Besides the workers listed in ``workers[]`` (static), a router can admit workers that register
themselves over HTTP (``accept_registrations``) and workers found by resolving a DNS name,
e.g. a Kubernetes headless service (``dns``). Both end up in the same pool as static ones.
"""

from __future__ import annotations

from pydantic import Field

from pdd.config.base import Section
from pdd.protocol import Role


class DnsDiscoveryConfig(Section):
    """One DNS name whose A/AAAA records are workers of one role (a headless service)."""

    name: str = Field(
        ...,
        min_length=1,
        description="DNS name to resolve, e.g. pdd-md.pdd.svc.cluster.local (a Kubernetes "
        "headless service answers one record per ready pod).",
    )
    role: Role = Field(..., description="Role of every worker behind the name.")
    port: int = Field(..., gt=0, lt=65536, description="Workers' gRPC port.")
    datacenter: str = Field("dc-a", description="Datacenter of every worker behind the name.")
    id_prefix: str | None = Field(
        None,
        description="Worker ids are PREFIX-ADDRESS; null: the name's first label.",
    )
    interval_s: float = Field(10.0, gt=0, description="How often the name is resolved.")


class FleetConfig(Section):
    """Registration and DNS discovery of workers (static `workers[]` always count too)."""

    accept_registrations: bool = Field(
        False,
        description="Serve POST/DELETE /internal/v1/workers: workers started with "
        "`--register URL` join the fleet and heartbeat. Protected by the router's API keys "
        "when authentication is on; leave off on a router reachable by untrusted clients "
        "without keys.",
    )
    heartbeat_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A registered worker with no heartbeat for this long is removed from the "
        "fleet (it is re-admitted by its next heartbeat).",
    )
    dns: list[DnsDiscoveryConfig] = Field(
        default_factory=list,
        description="DNS names resolved periodically into workers (one entry per role).",
    )
