"""MainDecode's landing reservations (pdd.main_decode.landing.DrcLanding) when the KV does not
come: a Generate that consumes a reservation no transfer ever reached frees its landing slots
at once and refuses late chunks; one consumed while a transfer is open keeps them until that
transfer ends, then releases them."""

from __future__ import annotations

import asyncio

import pytest

from pdd.cache.drc import DecodeRadixCache
from pdd.cache.hashing import block_hashes, model_salt
from pdd.config.cache import GIB, CacheConfig
from pdd.errors import TransferError
from pdd.main_decode.landing import DrcLanding
from pdd.transfer import InboundResult, TransferState
from pdd.transfer.wire import ChunkHeader

BLOCK_BYTES, BLOCK_SIZE = 16, 4


def landing(slots: int = 8) -> tuple[DrcLanding, DecodeRadixCache]:
    cfg = CacheConfig(host_capacity_gib=slots * BLOCK_BYTES / GIB)
    drc = DecodeRadixCache(cfg, BLOCK_BYTES, BLOCK_SIZE)
    return DrcLanding(drc, BLOCK_BYTES, default_lease_s=60), drc


def chain(n_blocks: int):
    return block_hashes(list(range(n_blocks * BLOCK_SIZE)), BLOCK_SIZE, model_salt("m", "f", 4))


def header(block: int, transfer_id: int = 1) -> ChunkHeader:
    return ChunkHeader(
        transfer_id=transfer_id, request_id="kv", chunk_index=block, chunk_count=3,
        segment_index=block, block_start=block, block_end=block + 1, layer_start=0,
        layer_end=1, dtype="uint8", shape=(BLOCK_BYTES,), offset=0, nbytes=BLOCK_BYTES,
        segment_nbytes=BLOCK_BYTES, total_bytes=3 * BLOCK_BYTES,
    )  # fmt: skip


def held(drc: DecodeRadixCache) -> int:
    s = drc.stats()
    return s.pinned_blocks + s.landing_blocks


def test_consumed_before_any_transfer_frees_the_slots_and_refuses_late_chunks():
    async def run():
        land, drc = landing()
        land.waiters.bind(asyncio.get_running_loop())
        land.prepare("kv", chain(3), 3 * BLOCK_SIZE, lease_s=60)
        assert held(drc) == 3 and land.expecting("kv")
        land.consume("kv")  # MD's Generate gave up waiting: it recomputes the prompt
        assert (held(drc), land.open_records, land.expecting("kv")) == (0, 0, False)
        with pytest.raises(TransferError, match="no DRC reservation"):
            land.allocate(header(0))  # P's chunk, too late
        state = await land.await_kv("kv", 0.1)
        assert (state.state, state.reason) == ("cancelled", "consumed before its KV arrived")

    asyncio.run(run())


def test_consumed_while_a_transfer_is_open_keeps_the_slots_until_it_ends():
    async def run():
        land, drc = landing()
        land.waiters.bind(asyncio.get_running_loop())
        land.prepare("kv", chain(3), 3 * BLOCK_SIZE, lease_s=60)
        land.allocate(header(0))
        land.consume("kv")
        assert held(drc) == 3 and land.open_records == 1
        land.received(InboundResult(1, "kv", TransferState.FAILED, "sender connection lost"))
        await asyncio.sleep(0)  # the settle runs on the loop
        assert (held(drc), land.open_records, drc.match(chain(3)).cached_blocks) == (0, 0, 0)

    asyncio.run(run())
