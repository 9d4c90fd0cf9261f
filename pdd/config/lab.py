"""Two-datacenter lab section (owned by pdd.lab)."""

from __future__ import annotations

from pydantic import Field

from pdd.config.base import Section


class LabConfig(Section):
    delay_ms: float = Field(10.0, ge=0, description="One-way delay of the WAN link (ms).")
    rate_mbit: float = Field(100.0, gt=0, description="WAN link rate (Mbit/s).")
    loss: float = Field(0.0, ge=0, lt=1, description="Packet loss probability on the WAN link.")
