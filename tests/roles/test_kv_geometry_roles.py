"""Self-describing KV over the real role policies (P, RLD, MD on real arenas and transports,
fake engines): P's chunks state its geometry; a receiver whose own geometry differs in dtype,
block size or layout (the same slot size: bytes that would land "fine") refuses every chunk,
counts it, and the request recomputes its prompt with the same tokens; no slot stays pinned
and no transfer stays open. RLD and MD convert another layout as it lands (the bytes:
tests/geometry/test_converted_landing.py); here they take every chunk of it. The dtype case
also halves head_dim to keep the slot size, and both refuse it on head_dim."""

from __future__ import annotations

import asyncio

import pytest

from pdd.kv_geometry import LAYOUT_KV_SPLIT, KvGeometry
from pdd.worker.kv_convert import convert_block
from pdd.worker.roles import AwaitKvCall
from tests.roles.fake_engine import block_bytes
from tests.roles.test_roles_fake import BS, SLOT, Topo, oracle, prepare, send, toks

# One block = 2 layers x 1 KV head x 4 tokens x (2 x 4) float32 = 256 bytes (SLOT).
GOOD = KvGeometry(fingerprint="m" * 32, num_layers=2, total_kv_heads=1, kv_head_end=1,
                  head_dim=4, block_size=BS, kv_dtype="float32")  # fmt: skip
SAME_BYTES = {  # each differs in one field and still fills exactly one 256-byte slot
    "dtype": GOOD.model_copy(update={"kv_dtype": "bfloat16", "head_dim": 8}),
    "block_size": GOOD.model_copy(update={"block_size": 2 * BS, "head_dim": 2}),
    "layout": GOOD.model_copy(update={"layout": LAYOUT_KV_SPLIT}),
}


def test_the_geometry_table_keeps_one_slot():
    assert GOOD.block_bytes == SLOT
    assert all(g.block_bytes == SLOT for g in SAME_BYTES.values())


CONVERTED = ("layout",)  # what both receivers convert rather than refuse


def run_pdd(field: str, receiver: str):
    """One p_rld_md request whose ``receiver`` holds ``SAME_BYTES[field]``; its tokens, MD's
    AwaitKv answer, the chunks RLD and MD refused, their loads and every worker's idle stats."""
    prompt = list(range(100, 118))  # 4 whole blocks + 2 tokens

    async def scenario():
        async with Topo() as topo:
            for wid in ("p", "rld", "md"):
                topo.engines[wid].kv_geometry = GOOD
            topo.engines[receiver].kv_geometry = own = SAME_BYTES[field]
            if field in CONVERTED:  # the receiver loads P's bytes converted into its own

                def expect(prefix: list[int], size: int) -> bytes:
                    out = bytearray(size)
                    convert_block(block_bytes(prefix, size), GOOD, out, own)
                    return bytes(out)

                topo.engines[receiver].expect = expect
            rld_prep = await prepare(topo, "rld", "r1", prompt)
            md_prep = await prepare(topo, "md", "r1", prompt)
            p = await topo.generate("p", "r1", prompt, 1, stage=True)
            await send(topo, "r1", [(rld_prep.address, 0), (md_prep.address, 0)])
            rld = await topo.generate("rld", "r1", prompt + toks(p), 2, source="transfer")
            emitted = toks(p) + toks(rld)
            req = AwaitKvCall(kv_request_id="r1", timeout_s=5)
            done = await topo.roles["md"].await_kv(req)
            md = await topo.generate("md", "r1", prompt + emitted, 5, source="drc")
            refused = tuple(topo.roles[w].kv_stats().kv_refused_chunks for w in ("rld", "md"))
            loads = (topo.engines["rld"].loads, topo.engines["md"].loads)
            return emitted + toks(md), done, refused, loads, await topo.idle()

    return (prompt, *asyncio.run(scenario()))


@pytest.mark.parametrize(("field", "receiver"),
                         [(f, r) for f in sorted(SAME_BYTES) for r in ("rld", "md")
                          if f not in CONVERTED])  # fmt: skip
def test_a_receiver_refuses_kv_of_another_geometry_and_recomputes(field: str, receiver: str):
    prompt, tokens, done, refused, (rld_loads, md_loads), stats = run_pdd(field, receiver)
    assert tokens == oracle(prompt, 8)  # the refusing receiver recomputed: the same tokens
    if receiver == "md":
        assert done.state == "failed" and "geometry" in done.reason
        assert refused[0] == 0 and refused[1] >= 1  # RLD (same geometry) took every chunk
        assert rld_loads == [("r1", 4, True)] and md_loads == []  # MD loaded none of P's KV
    else:
        assert done.state == "done" and refused[0] >= 1 and refused[1] == 0
        assert rld_loads == [] and md_loads == [("r1", 4, True)]
    assert all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values())


@pytest.mark.parametrize("receiver", ["rld", "md"])
def test_a_receiver_converts_another_layout_and_loads_every_block(receiver: str):
    prompt, tokens, done, refused, (rld_loads, md_loads), stats = run_pdd("layout", receiver)
    assert tokens == oracle(prompt, 8)
    assert done.state == "done" and refused == (0, 0)
    assert rld_loads == [("r1", 4, True)] and md_loads == [("r1", 4, True)]
    assert all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values())
