"""KV transfer section (owned by pdd.transfer)."""

from __future__ import annotations

from pydantic import Field

from pdd.config.base import Section


class TransferConfig(Section):
    wan_streams: int = Field(4, gt=0, description="Parallel TCP streams per WAN peer.")
    chunk_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Bytes per wire chunk.")
    deadline_s: float = Field(60.0, gt=0, description="Default deadline of one transfer.")
