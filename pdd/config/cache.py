"""Decode-side RadixCache section (owned by pdd.cache)."""

from __future__ import annotations

from pydantic import Field

from pdd.config.base import Section

GIB = 1 << 30


class CacheConfig(Section):
    host_capacity_gib: float = Field(
        2.0, gt=0, description="Host-memory tier of MainDecode's DRC, in GiB (LRU above)."
    )
    lease_ttl_s: float = Field(
        900.0,
        gt=0,
        description="Backstop lifetime of a request's lease on DRC blocks (pins and landing "
        "slots) when nobody releases it; longer than any request (router.request_timeout_s).",
    )
    event_log_size: int = Field(
        16384,
        gt=0,
        description="DRC events (BlockStored/BlockRemoved) kept for routers to catch up on; a "
        "router that falls further behind resyncs from a snapshot.",
    )

    def host_slots(self, block_bytes: int) -> int:
        """How many whole KV blocks of ``block_bytes`` the host tier holds."""
        return int(self.host_capacity_gib * GIB) // block_bytes
