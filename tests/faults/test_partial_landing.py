"""Partial landing on MainDecode (issue 16, Build item 2): a WAN transfer cut, cancelled or
failed after part of its blocks leaves exactly its verified prefix committed in the DRC (what
the next turn's PrepareKv finds cached), never a block that was only partly written.

Real code end to end without an engine: P's side is a real TCP transport whose sender is cut
at a chosen chunk (``pdd.transfer.faulty``: truncate); MD's side is a real TCP receiver whose
hooks are ``DrcLanding`` over a real ``DecodeRadixCache``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdd.cache.drc import DecodeRadixCache
from pdd.cache.hashing import block_hashes, model_salt
from pdd.config.cache import GIB, CacheConfig
from pdd.config.faults import KvChunkFault
from pdd.config.transfer import TransferConfig
from pdd.main_decode.landing import DrcLanding
from pdd.transfer import KVSegment, ReceiverHooks, SendRequest, TransferState, create_transport
from pdd.transfer.faulty import ChunkFaults
from pdd.transfer.testing import pattern
from pdd.transfer.wire import ChunkHeader
from tests.transfer.helpers import idle, wait_for

pytestmark = pytest.mark.timeout(60)
KiB = 1 << 10
CHUNK = 64 * KiB
BLOCK_SIZE = 4  # tokens per block
N_BLOCKS = 8


def chain(n_blocks: int):
    salt = model_salt("m", "f", BLOCK_SIZE)
    return block_hashes(list(range(n_blocks * BLOCK_SIZE)), BLOCK_SIZE, salt)


def block_data(i: int, block_bytes: int):
    return pattern(100 + i, block_bytes)


def committed(drc: DecodeRadixCache, n: int) -> list[bytes]:
    """The bytes of the committed prefix of ``chain(n)`` (pinned while read)."""
    drc.reserve("reader", chain(n)[: drc.match(chain(n)).cached_blocks], ttl_s=10)
    try:
        return [bytes(drc.read(slot)) for slot in drc.ready("reader").slots]
    finally:
        drc.release("reader")


def run_cut(block_bytes: int, cut_chunk: int, streams: int = 1):
    """MD prepares N_BLOCKS blocks; P sends them all and is cut at chunk ``cut_chunk``.
    Returns (DRC, AwaitKv's answer, next turn's cached blocks)."""
    cfg = CacheConfig(host_capacity_gib=4 * N_BLOCKS * block_bytes / GIB)
    drc = DecodeRadixCache(cfg, block_bytes, BLOCK_SIZE)
    land = DrcLanding(drc, block_bytes, default_lease_s=60)
    net = TransferConfig(
        deadline_s=10, chunk_bytes=CHUNK, min_chunk_bytes=CHUNK, wan_streams=streams
    )
    rules = [KvChunkFault(action="truncate", chunks=[cut_chunk])]
    # The cut comes once MD verified every chunk sent before it: a reset connection discards
    # what the receiver had not read yet, so without the wait "half" would be "half or less".
    verified = threading.Semaphore(0)

    def on_verified(header: ChunkHeader) -> None:
        land.verified(header)
        verified.release()

    def before_cut(header: ChunkHeader) -> None:
        if header.chunk_index == cut_chunk and streams == 1:
            for _ in range(cut_chunk):
                assert verified.acquire(timeout=10), "chunks before the cut never verified"

    faults = ChunkFaults("tcp", rules, deadline_s=10, on_chunk=before_cut)

    async def run():
        land.waiters.bind(asyncio.get_running_loop())
        hooks = ReceiverHooks(land.allocate, on_received=land.received, on_verified=on_verified)
        receiver = create_transport("tcp", net, hooks=hooks)
        sender = create_transport("tcp", net, faults=faults.hooks())
        receiver.start()
        sender.start()
        try:
            res = land.prepare("kv", chain(N_BLOCKS), N_BLOCKS * BLOCK_SIZE, lease_s=60)
            assert (res.cached_blocks, len(res.receive)) == (0, N_BLOCKS)
            segs = [
                KVSegment(block_data(i, block_bytes), i, i + 1, 0, 1, "uint8", (block_bytes,))
                for i in range(N_BLOCKS)
            ]
            handle = sender.send(receiver.address, SendRequest("kv", segs))
            status = await asyncio.to_thread(handle.wait, 20)
            assert status.state is TransferState.FAILED, status
            state = await land.await_kv("kv", 10)
            land.consume("kv")  # MD's Generate took what is there (and recomputes the rest)
            await asyncio.sleep(0.05)  # the settle runs on the loop
            for t in (sender, receiver):
                wait_for(lambda t=t: idle(t), 10, "transport to release everything")
            nxt = land.prepare("kv2", chain(N_BLOCKS), N_BLOCKS * BLOCK_SIZE, lease_s=60)
            land.cancel("kv2", "test over")
            return state, nxt.cached_blocks
        finally:
            faults.release()
            sender.close()
            receiver.close()

    state, next_cached = asyncio.run(run())
    stats = drc.stats()
    assert (stats.pinned_blocks, stats.landing_blocks, land.open_records) == (0, 0, 0)
    return drc, state, next_cached


def test_a_transfer_cut_after_half_its_blocks_leaves_exactly_that_half():
    drc, state, next_cached = run_cut(CHUNK, cut_chunk=N_BLOCKS // 2)  # 1 chunk per block
    assert state.state == "failed"
    assert state.blocks_ready == N_BLOCKS // 2
    assert next_cached == N_BLOCKS // 2  # the next turn's md_cached_tokens: 4 blocks
    assert committed(drc, N_BLOCKS) == [bytes(block_data(i, CHUNK)) for i in range(4)]


def test_a_block_cut_midway_never_commits():
    # two chunks per block: chunks 0-3 are blocks 0-1, chunk 4 is half of block 2, cut at 5
    drc, state, next_cached = run_cut(2 * CHUNK, cut_chunk=5)
    assert (state.state, state.blocks_ready, next_cached) == ("failed", 2, 2)
    assert committed(drc, N_BLOCKS) == [bytes(block_data(i, 2 * CHUNK)) for i in range(2)]


def test_parallel_streams_commit_only_a_verified_prefix():
    # 4 streams: blocks after the cut may arrive before it; only a gap-free prefix commits
    drc, state, next_cached = run_cut(CHUNK, cut_chunk=3, streams=4)
    assert state.blocks_ready == next_cached <= 3
    assert committed(drc, N_BLOCKS) == [bytes(block_data(i, CHUNK)) for i in range(next_cached)]


def _header(block: int, offset: int, nbytes: int, block_bytes: int) -> ChunkHeader:
    return ChunkHeader(
        transfer_id=1, request_id="kv", chunk_index=2 * block + offset // nbytes,
        chunk_count=2 * N_BLOCKS, segment_index=block, block_start=block, block_end=block + 1,
        layer_start=0, layer_end=1, dtype="uint8", shape=(block_bytes,), offset=offset,
        nbytes=nbytes, segment_nbytes=block_bytes, total_bytes=N_BLOCKS * block_bytes,
    )  # fmt: skip


def test_a_repeated_half_chunk_does_not_complete_its_block():
    """Only byte ranges that tile the whole block land it: the same half twice does not."""
    block_bytes = 32
    drc = DecodeRadixCache(CacheConfig(host_capacity_gib=64 * block_bytes / GIB), block_bytes, 4)
    land = DrcLanding(drc, block_bytes, default_lease_s=60)
    land.prepare("kv", chain(N_BLOCKS), N_BLOCKS * BLOCK_SIZE, lease_s=60)
    first_half = _header(0, 0, block_bytes // 2, block_bytes)
    for _ in range(2):
        land.allocate(first_half)[:] = b"\x01" * (block_bytes // 2)
        land.verified(first_half)
    assert drc.ready("kv").cached_blocks == 0
    second_half = _header(0, block_bytes // 2, block_bytes // 2, block_bytes)
    land.allocate(second_half)[:] = b"\x02" * (block_bytes // 2)
    land.verified(second_half)
    assert drc.ready("kv").cached_blocks == 1  # committed while the transfer still runs
    land.release_all()


def test_a_landing_kept_without_a_generate_lands_whole_then_releases_itself():
    """CancelKv(background) on MD (RLD ended the request first): no Generate will read the
    KV, yet every block still lands in the DRC (the next turn's cached prefix), the transfer
    sent after the keep included, and the reservation lets go of every pin by itself."""
    block_bytes = CHUNK
    cfg = CacheConfig(host_capacity_gib=4 * N_BLOCKS * block_bytes / GIB)
    drc = DecodeRadixCache(cfg, block_bytes, BLOCK_SIZE)
    land = DrcLanding(drc, block_bytes, default_lease_s=60)
    net = TransferConfig(deadline_s=10, chunk_bytes=CHUNK, min_chunk_bytes=CHUNK)

    async def run():
        land.waiters.bind(asyncio.get_running_loop())
        hooks = ReceiverHooks(land.allocate, on_received=land.received, on_verified=land.verified)
        receiver = create_transport("tcp", net, hooks=hooks)
        sender = create_transport("tcp", net)
        receiver.start()
        sender.start()
        try:
            land.prepare("kv", chain(N_BLOCKS), N_BLOCKS * BLOCK_SIZE, lease_s=60)
            assert land.keep("kv", "rld_finished")  # before any chunk arrived
            assert not land.keep("unknown", "rld_finished")
            segs = [
                KVSegment(block_data(i, block_bytes), i, i + 1, 0, 1, "uint8", (block_bytes,))
                for i in range(N_BLOCKS)
            ]
            handle = sender.send(receiver.address, SendRequest("kv", segs))
            handle.defer()
            status = await asyncio.to_thread(handle.wait, 20)
            assert status.state is TransferState.DONE, status
            for _ in range(200):  # the settle runs on the loop
                if land.open_records == 0:
                    break
                await asyncio.sleep(0.02)
            for t in (sender, receiver):
                wait_for(lambda t=t: idle(t), 10, "transport to release everything")
        finally:
            sender.close()
            receiver.close()

    asyncio.run(run())
    stats = drc.stats()
    assert (stats.pinned_blocks, stats.landing_blocks, land.open_records) == (0, 0, 0)
    assert committed(drc, N_BLOCKS) == [bytes(block_data(i, CHUNK)) for i in range(N_BLOCKS)]


def test_a_kept_landing_gives_its_room_up_to_a_new_request():
    """A DRC of 8 blocks, all reserved by a kept landing (its KV still on its way for a later
    turn): a new request's PrepareKv for 8 other blocks takes the room instead of a refusal,
    and the kept landing ends cancelled."""
    block_bytes = CHUNK
    cfg = CacheConfig(host_capacity_gib=N_BLOCKS * block_bytes / GIB)
    drc = DecodeRadixCache(cfg, block_bytes, BLOCK_SIZE)
    land = DrcLanding(drc, block_bytes, default_lease_s=60)
    other = block_hashes(list(range(1000, 1000 + N_BLOCKS * BLOCK_SIZE)), BLOCK_SIZE,
                         model_salt("m", "f", BLOCK_SIZE))  # fmt: skip

    async def run():
        land.waiters.bind(asyncio.get_running_loop())
        land.prepare("kept", chain(N_BLOCKS), N_BLOCKS * BLOCK_SIZE, lease_s=60)
        assert land.kept_room() == 0  # a Generate will still read it: not room
        assert land.keep("kept", "rld_finished")
        assert land.kept_room() == N_BLOCKS  # MD reports it in its free room
        res = land.prepare("new", other, N_BLOCKS * BLOCK_SIZE, lease_s=60)
        assert land.kept_room() == 0
        state = await land.await_kv("kept", 1)
        land.cancel("new", "test over")
        return len(res.receive), state.state

    assert asyncio.run(run()) == (N_BLOCKS, "cancelled")
    assert (drc.stats().pinned_blocks, drc.stats().landing_blocks, land.open_records) == (0, 0, 0)
