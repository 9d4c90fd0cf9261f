"""Decode-side RadixCache section (owned by pdd.cache)."""

from __future__ import annotations

from pydantic import Field

from pdd.config.base import Section


class CacheConfig(Section):
    host_capacity_gib: float = Field(
        2.0, gt=0, description="Host-memory tier of MainDecode's DRC, in GiB (LRU above)."
    )
