"""Two-datacenter lab section (owned by pdd.lab).

The lab emulates datacenters A and B on one host with network namespaces joined by a shaped
WAN link (kernel tbf for the rate, a userspace relay for the one-way delay and the loss).
Every name and address the lab makes derives from ``prefix`` and ``subnet``, so two labs with
different prefixes and subnets run side by side.
"""

from __future__ import annotations

from ipaddress import IPv4Network
from pathlib import Path

from pydantic import Field, field_validator

from pdd.config.base import Section


class LabConfig(Section):
    delay_ms: float = Field(
        10.0, ge=0, le=10_000, description="One-way delay of the WAN link (ms)."
    )
    rate_mbit: float = Field(
        100.0, gt=0, le=10_000, description="WAN link rate in Mbit/s of IP bytes, each direction."
    )
    loss: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Probability that a packet crossing the WAN is dropped, drawn per packet "
        "and per direction.",
    )
    mtu: int = Field(
        1500,
        ge=576,
        le=65_000,
        description="MTU of the WAN link. The relay's CPU cost is per packet: use 9000 for "
        "links of several hundred Mbit/s and more.",
    )
    queue_bytes: int | None = Field(
        None,
        gt=0,
        description="Tail-drop queue of each WAN direction in bytes (the tbf limit). Null: one "
        "bandwidth-delay product (rate x 2 x delay), at least 16 packets.",
    )
    prefix: str = Field(
        "pdd",
        pattern=r"^[a-z][a-z0-9]{0,7}$",
        description="Name prefix of everything the lab makes: namespaces PREFIX-dc-a and "
        "PREFIX-dc-b, host links PREFIX-a and PREFIX-b, state in run_dir/PREFIX.",
    )
    subnet: IPv4Network = Field(
        IPv4Network("10.77.0.0/28"),
        description="Private IPv4 block (/28 or larger) the lab takes its addresses from; it "
        "uses the first 16 addresses. Labs that run side by side need disjoint subnets.",
    )
    run_dir: Path = Field(
        Path("/run/pdd-lab"),
        description="Where a running lab keeps its pid files, state and log (one folder per "
        "prefix).",
    )

    @field_validator("subnet")
    @classmethod
    def _subnet_fits(cls, net: IPv4Network) -> IPv4Network:
        if net.prefixlen > 28:
            raise ValueError(f"subnet {net} is smaller than a /28 (the lab needs 16 addresses)")
        if not net.is_private:
            raise ValueError(f"subnet {net} is not a private range")
        return net
