"""MainDecode lands KV that P sent in another dtype or layout, converted into its own
(``pdd.main_decode.landing.DrcLanding`` over a real DRC, chunks cut by the real planner):
every block the DRC commits holds exactly ``kv_convert``'s answer, widening is bit-exact,
a block whose chunks did not all arrive never commits, and nothing stays pinned."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdd.cache.drc import DecodeRadixCache
from pdd.cache.hashing import block_hashes, model_salt
from pdd.config.cache import GIB, CacheConfig
from pdd.kv_geometry import LAYOUT_KV_SPLIT, KvGeometry
from pdd.main_decode.landing import DrcLanding
from pdd.transfer import InboundResult, KVSegment, SendRequest, TransferState
from pdd.transfer.wire import plan_chunks
from pdd.worker.kv_convert import convert_block
from pdd.worker.kv_wire import describe

BS = 4
# One block: 2 layers x 2 KV heads x 4 tokens x (2 x 4) = 128 values.
F32 = KvGeometry(fingerprint="m" * 32, num_layers=2, total_kv_heads=2, kv_head_end=2,
                 head_dim=4, block_size=BS, kv_dtype="float32")  # fmt: skip
BF16_SPLIT = F32.model_copy(update={"kv_dtype": "bfloat16", "layout": LAYOUT_KV_SPLIT})
PAIRS = {
    "bf16 split -> f32 packed": (BF16_SPLIT, F32),
    "f32 packed -> bf16 split": (F32, BF16_SPLIT),
}


def blocks_of(g: KvGeometry, n: int, seed: int = 0) -> list[bytes]:
    """``n`` blocks of random KV in ``g`` (bfloat16: every bit pattern but NaNs is fair)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n * g.block_bytes // g.dtype_bytes).astype(np.float32)
    if g.kv_dtype == "bfloat16":
        values = values.view(np.uint32) >> 16  # exact bfloat16 values
        return [values.astype(np.uint16)[i::n].tobytes() for i in range(n)]
    return [values[i::n].tobytes() for i in range(n)]


def receiver(own: KvGeometry, slots: int = 8):
    drc = DecodeRadixCache(CacheConfig(host_capacity_gib=slots * own.block_bytes / GIB),
                           own.block_bytes, BS)  # fmt: skip
    land = DrcLanding(drc, own.block_bytes, default_lease_s=60, geometry=lambda: own)
    return land, drc


def send(land: DrcLanding, src: KvGeometry, blocks: list[bytes], *, stop_at: int | None = None):
    """Every chunk (a block cut in three) through allocate -> write -> verified, as the TCP
    receiver does; ``stop_at``: the transfer fails before that chunk. Returns its result."""
    segments = [KVSegment(b, block_start=i, block_end=i + 1, **describe(src))
                for i, b in enumerate(blocks)]  # fmt: skip
    plan = plan_chunks(7, SendRequest("kv", segments), src.block_bytes // 3 + 1, algo=0)
    for n, chunk in enumerate(plan):
        if n == stop_at:
            return InboundResult(7, "kv", TransferState.FAILED, "sender connection lost")
        land.allocate(chunk.header)[:] = chunk.view
        land.verified(chunk.header)
    return InboundResult(7, "kv", TransferState.DONE, "")


def chain(n: int):
    return block_hashes(list(range(n * BS)), BS, model_salt("m", "float32", BS))


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_each_committed_block_holds_the_converted_kv(pair: str):
    src, own = PAIRS[pair]

    async def run():
        land, drc = receiver(own)
        land.waiters.bind(asyncio.get_running_loop())
        land.prepare("kv", chain(3), 3 * BS, lease_s=60)
        sent = blocks_of(src, 3)
        land.received(send(land, src, sent))
        done = await land.await_kv("kv", 1)
        ready = drc.ready("kv")
        got = [bytes(drc.read(slot)) for slot in ready.slots]
        land.consume("kv")
        await asyncio.sleep(0)
        return sent, got, done, land.wire_check.refused, drc.stats()

    sent, got, done, refused, stats = asyncio.run(run())
    assert (done.state, done.blocks_ready, refused) == ("done", 3, 0)
    for raw, landed in zip(sent, got, strict=True):
        want = bytearray(own.block_bytes)
        convert_block(raw, src, want, own)
        assert landed == bytes(want)
        if own.kv_dtype == "float32":  # widening: converting back gives P's bytes exactly
            back = bytearray(src.block_bytes)
            convert_block(landed, own, back, src)
            assert bytes(back) == raw
    assert (stats.pinned_blocks, stats.landing_blocks, stats.committed_blocks) == (0, 0, 3)


def test_a_cut_transfer_commits_only_the_blocks_that_arrived_whole():
    async def run():
        land, drc = receiver(F32)
        land.waiters.bind(asyncio.get_running_loop())
        land.prepare("kv", chain(3), 3 * BS, lease_s=60)
        land.received(send(land, BF16_SPLIT, blocks_of(BF16_SPLIT, 3), stop_at=4))
        await asyncio.sleep(0)  # the settle runs on the loop
        land.consume("kv")
        await asyncio.sleep(0)
        return drc.match(chain(3)).cached_blocks, drc.stats(), land.open_records

    cached, stats, records = asyncio.run(run())
    assert cached == 1  # block 0 whole (chunks 0-2), block 1 had one chunk of three
    assert (stats.pinned_blocks, stats.landing_blocks, records) == (0, 0, 0)
