"""MainDecode lands KV that P sent in another dtype, layout or block size, converted into its
own (``pdd.main_decode.landing.DrcLanding`` over a real DRC, chunks cut by the real planner):
every block the DRC commits holds exactly ``kv_convert``'s answer (the same tokens' KV in
MD's blocks), widening is bit-exact, a block whose chunks or tokens did not all arrive never
commits, a cached prefix is skipped, and nothing stays pinned. RelayDecode does the same into
its staging slots (``pdd.relay_decode.policy.PoolSource``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdd.cache.arena import SlotArena
from pdd.cache.drc import DecodeRadixCache
from pdd.cache.hashing import block_hashes, model_salt
from pdd.config.cache import GIB, CacheConfig
from pdd.kv_geometry import LAYOUT_KV_SPLIT, RECEIVER_CONVERTS, KvGeometry
from pdd.main_decode.landing import DrcLanding
from pdd.protocol import Role
from pdd.relay_decode.policy import PoolSource
from pdd.transfer import InboundResult, KVSegment, SendRequest, TransferState
from pdd.transfer.wire import plan_chunks
from pdd.worker.inbound import wire_id
from pdd.worker.kv_convert import convert_block
from pdd.worker.kv_wire import KvWireCheck, describe
from pdd.worker.landing import Landings
from pdd.worker.slots import SlotPool

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
                           own.block_bytes, own.block_size)  # fmt: skip
    land = DrcLanding(drc, own.block_bytes, default_lease_s=60, geometry=lambda: own)
    return land, drc


def send(land: DrcLanding, src: KvGeometry, blocks: list[bytes], *, stop_at: int | None = None,
         first: int = 0, kv_id: str = "kv", tid: int = 7):  # fmt: skip
    """Every chunk (a block cut in three) through allocate -> write -> verified, as the TCP
    receiver does; ``stop_at``: the transfer fails before that chunk. Returns its result."""
    segments = [KVSegment(b, block_start=i, block_end=i + 1, **describe(src))
                for i, b in enumerate(blocks) if i >= first]  # fmt: skip
    plan = plan_chunks(tid, SendRequest(kv_id, segments), src.block_bytes // 3 + 1, algo=0)
    for n, chunk in enumerate(plan):
        if n == stop_at:
            return InboundResult(tid, kv_id, TransferState.FAILED, "sender connection lost")
        land.allocate(chunk.header)[:] = chunk.view
        land.verified(chunk.header)
    return InboundResult(tid, kv_id, TransferState.DONE, "")


def chain(n: int, block_size: int = BS, tokens: int | None = None):
    ids = list(range(tokens if tokens is not None else n * block_size))
    return block_hashes(ids, block_size, model_salt("m", "float32", block_size))


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


# --- block sizes --------------------------------------------------------------------------


def token_kv(n_tokens: int, seed: int = 1) -> np.ndarray:
    """Every token's KV, float32 [L, 2, tokens, H, D] (the K/V-split layout, tokens on axis 2)."""
    shape = (F32.num_layers, 2, n_tokens, F32.heads_held, F32.head_dim)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def blocks_in(kv: np.ndarray, g: KvGeometry) -> list[bytes]:
    """The whole blocks of ``kv``'s tokens in geometry ``g``."""
    out, b = [], g.block_size
    split = F32.model_copy(update={"block_size": b, "layout": LAYOUT_KV_SPLIT})
    for i in range(kv.shape[2] // b):
        raw, dst = (
            np.ascontiguousarray(kv[:, :, i * b : (i + 1) * b]).tobytes(),
            bytearray(g.block_bytes),
        )
        convert_block(raw, split, dst, g)
        out.append(bytes(dst))
    return out


def as_sent(kv: np.ndarray, src: KvGeometry) -> np.ndarray:
    """``kv`` as P's dtype holds it (bfloat16: rounded), back in float32."""
    if src.kv_dtype == "float32":
        return kv
    return (kv.view(np.uint32) + 0x7FFF + ((kv.view(np.uint32) >> 16) & 1) & 0xFFFF0000).view(
        np.float32
    )


REGROUPS = {  # name: (P's geometry, MD's geometry, prompt tokens)
    "P 4 -> MD 8, f32": (F32, F32.model_copy(update={"block_size": 8}), 36),
    "P 8 -> MD 4, f32, tail": (F32.model_copy(update={"block_size": 8}), F32, 22),
    "P 8 bf16 split -> MD 12 f32": (BF16_SPLIT.model_copy(update={"block_size": 8}),
                                    F32.model_copy(update={"block_size": 12}), 44),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REGROUPS))
def test_md_regroups_ps_blocks_into_its_own_block_size(case: str):
    """MD's DRC holds, block for block, the KV of the same tokens in its own block size; a
    block P's whole blocks do not cover (P 8 -> MD 4 over 22 tokens: MD's block 4, tokens
    16-19) never commits; the next turn sends from P's block that holds MD's first missing
    token, and MD's cached block it overlaps is left alone."""
    src, own, n = REGROUPS[case]
    kv = token_kv(n + 2 * own.block_size)
    md_chain = chain(0, own.block_size, n)
    p_blocks = blocks_in(kv[:, :, :n], src)
    n_md = len(md_chain)

    async def run():
        land, drc = receiver(own, slots=16)
        land.waiters.bind(asyncio.get_running_loop())
        land.prepare("t1", md_chain, n, lease_s=60)
        land.received(send(land, src, p_blocks, kv_id="t1"))
        await land.await_kv("t1", 1)
        got = [bytes(drc.read(slot)) for slot in drc.ready("t1").slots]
        land.consume("t1")
        # turn 2: two more of MD's blocks; MD holds turn 1's; P sends from the block that
        # holds MD's first missing token
        n2 = n + 2 * own.block_size
        chain2 = chain(0, own.block_size, n2)
        res = land.prepare("t2", chain2, n2, lease_s=60)
        first = res.cached_tokens // src.block_size
        land.received(send(land, src, blocks_in(kv[:, :, :n2], src), first=first, kv_id="t2"))
        await land.await_kv("t2", 1)
        got2 = [bytes(drc.read(slot)) for slot in drc.ready("t2").slots]
        land.consume("t2")
        await asyncio.sleep(0)
        return got, res.cached_blocks, got2, drc.stats()

    got, cached2, got2, stats = asyncio.run(run())
    want = blocks_in(as_sent(kv, src), own)
    whole = n // src.block_size * src.block_size // own.block_size  # MD blocks P's blocks cover
    assert got == want[:whole] and whole == (4 if "tail" in case else n_md)
    assert cached2 == whole
    assert got2 == want[: len(got2)] and len(got2) >= n_md  # the tail block came with turn 2
    assert (stats.pinned_blocks, stats.landing_blocks) == (0, 0)


@pytest.mark.parametrize("case", sorted(REGROUPS))
def test_a_streamed_send_lands_like_a_whole_one(case: str):
    """P streams its blocks while it prefills: its parts end on P's block boundaries, which
    may fall inside MD's blocks; a part with more to follow leaves what it began for the next,
    so MD's DRC ends up holding exactly what one whole send leaves, and the KV counts as there
    only once the last part landed."""
    src, own, n = REGROUPS[case]
    kv = token_kv(n)
    md_chain = chain(0, own.block_size, n)
    p_blocks = blocks_in(kv[:, :, :n], src)
    cuts = sorted({0, 1, max(1, len(p_blocks) - 1), len(p_blocks)})  # the first block alone

    async def run():
        land, drc = receiver(own, slots=16)
        land.waiters.bind(asyncio.get_running_loop())
        land.prepare("s", md_chain, n, lease_s=60)
        there = []
        for k, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            parts = len(cuts) - 1 if b == cuts[-1] else None  # None: more follow
            rid = wire_id("s", "", parts)
            land.received(send(land, src, p_blocks[:b], first=a, kv_id=rid, tid=10 + k))
            there.append(land.terminal("s"))
        await land.await_kv("s", 1)
        got = [bytes(drc.read(slot)) for slot in drc.ready("s").slots]
        land.consume("s")
        await asyncio.sleep(0)
        return there, got, drc.stats()

    there, got, stats = asyncio.run(run())
    want = blocks_in(as_sent(kv, src), own)
    whole = n // src.block_size * src.block_size // own.block_size  # MD blocks P's blocks cover
    assert there == [False] * (len(cuts) - 2) + [True]
    assert got == want[:whole]
    assert (stats.pinned_blocks, stats.landing_blocks) == (0, 0)


# --- RelayDecode: the same conversion into its staging slots ------------------------------


def relay(own: KvGeometry, slots: int = 16):
    """RLD's landings over its real staging pool and shared-memory arena."""
    arena = SlotArena.create(slots, own.block_bytes, name_prefix="pdd-test")
    pool = SlotPool(slots)
    check = KvWireCheck(own.block_bytes, lambda: own, RECEIVER_CONVERTS[Role.RELAY_DECODE])
    source = PoolSource(pool, arena, lambda: own)
    land = Landings(source, check, lease_s=60)
    return land, source, pool, arena


@pytest.mark.parametrize("case", sorted(REGROUPS))
def test_rld_regroups_ps_blocks_into_its_own_slots(case: str):
    """RLD's slots hold, block for block, the KV of the same tokens in its own geometry, and
    only the prefix P's whole blocks cover is loadable (P 8 -> RLD 4 over 22 tokens: RLD's
    block 4, tokens 16-19, is not); every slot is released after."""
    src, own, n = REGROUPS[case]
    kv = token_kv(n)
    p_blocks = blocks_in(kv, src)
    n_rld = n // own.block_size
    land, source, pool, arena = relay(own)
    try:
        take = lambda held, _lease: source.reserve("kv", held, n, own.block_size)  # noqa: E731
        land.reserve("kv", 60, False, take)
        land.received(send(land, src, p_blocks))
        rec = land.take("kv")
        assert rec is not None
        loadable = rec.slots.loadable(n_rld)
        got = [bytes(arena.view(slot)) for slot in loadable]
        land.done_with(rec)
        refused, in_use = land.wire_check.refused, pool.in_use
    finally:
        arena.close()
        arena.unlink()
    whole = n // src.block_size * src.block_size // own.block_size
    assert got == blocks_in(as_sent(kv, src), own)[:whole]
    assert len(got) == (4 if "tail" in case else n_rld)
    assert (refused, in_use, land.open_records) == (0, 0, 0)


def test_rld_loads_nothing_of_a_converted_transfer_cut_mid_way():
    src, own = BF16_SPLIT, F32
    land, source, pool, arena = relay(own)
    try:
        land.reserve("kv", 60, False, lambda held, _lease: source.reserve("kv", held, 3 * BS, BS))
        land.received(send(land, src, blocks_of(src, 3), stop_at=4))
        rec = land.take("kv")  # a failed transfer: the Generate computes the prompt
        in_use = pool.in_use
    finally:
        arena.close()
        arena.unlink()
    assert (rec, in_use, land.open_records) == (None, 0, 0)


def test_rld_loads_ps_tail_to_the_end_of_its_prompt_once_it_came():
    """P's tail (the block its prompt ends inside), which P sends an RLD of its own geometry
    when the router asks: once it came, a Generate of P's prompt and token loads it up to the
    end of PrepareKv's prompt (RLD computes P's token alone); without it, only the whole
    blocks load. A Generate no longer than P's prompt loads whole blocks either way. Every
    slot (the reserved tail's too) is released after."""
    n = 3 * BS + 2  # 3 whole blocks and a 2-token tail
    blocks = blocks_of(F32, 4)
    for sent, want in ((blocks[:3], (3, None)), (blocks, (4, n))):
        land, source, pool, arena = relay(F32)
        try:
            take = lambda held, _lease, source=source: source.reserve("kv", held, n, BS)  # noqa: E731
            land.reserve("kv", 60, False, take)
            land.received(send(land, F32, sent))
            rec = land.take("kv")
            assert rec is not None
            slots, tokens = rec.slots.load(n + 1, BS)  # P's prompt and P's token
            alone = rec.slots.load(n, BS)
            got = [bytes(arena.view(slot)) for slot in slots]
            land.done_with(rec)
            in_use = pool.in_use
        finally:
            arena.close()
            arena.unlink()
        assert (len(slots), tokens) == want
        assert got == sent[: len(slots)]
        assert alone == (slots[:3], None)
        assert (in_use, land.open_records) == (0, 0)
