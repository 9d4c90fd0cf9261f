"""Typed messages a Decode-side RadixCache exports: events, snapshots and stats.

A router keeps one PrefixIndexView (pdd.cache.view) per MainDecode instance and feeds it:

* ``DrcSnapshot``: every cached block hash at sequence number ``seq`` (a full resync).
* ``DrcEventBatch``: the events after a sequence number. Events are numbered 1, 2, 3, ... per
  cache ``epoch`` (a cache restart starts a new epoch at 0). A view that sees a hole in the
  numbers, or another epoch, takes a snapshot again.

Events keep the exported set prefix-closed after each one: ``BlockStored`` lists a chain in
order (first block a child of ``parent_hash``), ``BlockRemoved`` lists children before
parents. Hashes are 16-byte chain hashes (pdd.cache.hashing), base64 in JSON.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdd.cache.hashing import HASH_BYTES

HashField = Annotated[bytes, Field(min_length=HASH_BYTES, max_length=HASH_BYTES)]


class _Message(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, ser_json_bytes="base64", val_json_bytes="base64"
    )


class BlockStored(_Message):
    """Blocks became visible in the cache (committed after landing)."""

    kind: Literal["stored"] = "stored"
    seq: int = Field(..., ge=1, description="Sequence number of this event in its epoch.")
    parent_hash: HashField | None = Field(
        ..., description="Parent of the first block; null for a prompt's first block."
    )
    block_hashes: tuple[HashField, ...] = Field(..., description="A chain, root side first.")


class BlockRemoved(_Message):
    """Blocks left the cache (evicted or removed)."""

    kind: Literal["removed"] = "removed"
    seq: int = Field(..., ge=1, description="Sequence number of this event in its epoch.")
    block_hashes: tuple[HashField, ...] = Field(..., description="Children before parents.")


DrcEvent = Annotated[BlockStored | BlockRemoved, Field(discriminator="kind")]


class DrcEventBatch(_Message):
    """The retained events after some sequence number."""

    epoch: str = Field(..., description="Identity of this cache's life; changes on restart.")
    block_size: int = Field(..., gt=0, description="Tokens per block.")
    last_seq: int = Field(..., ge=0, description="The cache's newest sequence number.")
    events: tuple[DrcEvent, ...] = Field(..., description="In sequence order.")


class DrcSnapshot(_Message):
    """Every cached block at sequence number ``seq``."""

    epoch: str = Field(..., description="Identity of this cache's life; changes on restart.")
    seq: int = Field(..., ge=0, description="Sequence number of the last event included.")
    block_size: int = Field(..., gt=0, description="Tokens per block.")
    block_hashes: tuple[HashField, ...] = Field(..., description="Every committed block.")


class DrcStats(_Message):
    """Counters and gauges of one cache (metrics, the router's debug view)."""

    epoch: str = Field(..., description="Identity of this cache's life.")
    block_size: int = Field(..., description="Tokens per block.")
    block_bytes: int = Field(..., description="Bytes per block in the host tier.")
    capacity_blocks: int = Field(..., description="Slots in the host tier.")
    committed_blocks: int = Field(..., description="Blocks visible to lookups.")
    landing_blocks: int = Field(..., description="Slots reserved for blocks still landing.")
    free_blocks: int = Field(..., description="Slots holding nothing.")
    pinned_blocks: int = Field(..., description="Committed blocks with at least one pin.")
    evictable_blocks: int = Field(..., description="Blocks eviction could free now.")
    fill_ratio: float = Field(..., description="(committed + landing) / capacity.")
    lookups: int = Field(..., description="match() calls.")
    requests: int = Field(..., description="Reservations made.")
    prompt_tokens: int = Field(..., description="Prompt tokens of all reservations.")
    hit_tokens: int = Field(..., description="Of those, tokens already cached at reserve.")
    stored_blocks: int = Field(..., description="Blocks committed as new.")
    deduplicated_blocks: int = Field(..., description="Landed blocks that were cached already.")
    discarded_blocks: int = Field(..., description="Landing slots freed without commit.")
    evicted_blocks: int = Field(..., description="Blocks evicted (LRU).")
    removed_blocks: int = Field(..., description="Blocks removed explicitly.")
    active_leases: int = Field(..., description="Requests holding a lease.")
    expired_leases: int = Field(..., description="Leases released by their deadline.")
    event_seq: int = Field(..., description="Newest event sequence number.")
