"""Two-datacenter lab section (owned by pdd.lab).

The lab emulates datacenters A and B on one host with network namespaces joined by a shaped
WAN link (kernel tbf for the rate, a userspace relay for the one-way delay and the loss).
Every name and address the lab makes derives from ``prefix`` and ``subnet``, so two labs with
different prefixes and subnets run side by side.
"""

from __future__ import annotations

from ipaddress import IPv4Network
from pathlib import Path

from pydantic import Field, field_validator, model_validator

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
    loss_b_to_a: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Loss of the dc-b -> dc-a direction when it differs (asymmetric loss); "
        "null: `loss` both ways.",
    )
    jitter_ms: float = Field(
        0.0,
        ge=0,
        le=10_000,
        description="Chaos: each packet waits up to this much longer than delay_ms (uniform); "
        "packets keep their order unless `reorder` is set.",
    )
    reorder: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Chaos: probability that a packet is held back reorder_ms longer, so the "
        "packets behind it overtake it.",
    )
    reorder_ms: float = Field(
        5.0, gt=0, le=10_000, description="How much longer a reordered packet is held back."
    )
    duplicate: float = Field(
        0.0, ge=0, lt=1, description="Chaos: probability that a packet is delivered twice."
    )
    flap_every_s: float = Field(
        0.0,
        ge=0,
        description="Chaos: the link goes down (both directions drop everything) once every "
        "this many seconds, for flap_down_s; 0: never.",
    )
    flap_down_s: tuple[float, float] = Field(
        (1.0, 5.0),
        description="Chaos: how long each outage lasts, drawn uniformly from [min, max] seconds.",
    )
    rate_factors: tuple[float, ...] = Field(
        (),
        description="Chaos: bandwidth that changes under running transfers: every "
        "rate_change_every_s the link runs at the next factor x rate_mbit (cycling), e.g. "
        "[1, 0.25]. Empty: a constant rate.",
    )
    rate_change_every_s: float = Field(
        10.0, gt=0, description="How long each of rate_factors lasts."
    )
    chaos_seed: int | None = Field(
        None, description="Seed of every chaos draw (loss too): the same seed, the same link."
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

    @field_validator("flap_down_s")
    @classmethod
    def _outage_range(cls, down: tuple[float, float]) -> tuple[float, float]:
        if not 0 < down[0] <= down[1]:
            raise ValueError(f"flap_down_s {list(down)} is not a range [min, max] with 0 < min")
        return down

    @field_validator("rate_factors")
    @classmethod
    def _positive_factors(cls, factors: tuple[float, ...]) -> tuple[float, ...]:
        if any(f <= 0 for f in factors):
            raise ValueError(f"rate_factors {list(factors)} must all be > 0")
        return factors

    @model_validator(mode="after")
    def _outages_fit(self) -> LabConfig:
        if self.flap_every_s and self.flap_down_s[1] >= self.flap_every_s:
            raise ValueError(
                f"flap_down_s up to {self.flap_down_s[1]} s does not fit in flap_every_s "
                f"{self.flap_every_s} s (the link would never come back)"
            )
        return self

    @field_validator("subnet")
    @classmethod
    def _subnet_fits(cls, net: IPv4Network) -> IPv4Network:
        if net.prefixlen > 28:
            raise ValueError(f"subnet {net} is smaller than a /28 (the lab needs 16 addresses)")
        if not net.is_private:
            raise ValueError(f"subnet {net} is not a private range")
        return net
