"""The three role policies over real shell mechanism (arenas, fences, inproc/TCP transports)
and a fake engine that plays vLLM and the KV connector (tests/roles/fake_engine.py).

Fast and exact: block ids, slot counts and release order, no vLLM. Each test builds P, RLD
and MD in this process and ends with the leak check (no pinned slot, no open transfer).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest

from pdd.config import CacheConfig, PddConfig, TransferConfig, WorkerConfig
from pdd.config.faults import FaultsConfig, KvChunkFault
from pdd.engine.types import SamplingSpec
from pdd.errors import CacheError, ContextLengthError, OverloadedError
from pdd.main_decode import MainDecodeRole
from pdd.prefill import PrefillRole
from pdd.relay_decode import RelayDecodeRole
from pdd.worker.kv_plane import KvPlane, PlaneSpec
from pdd.worker.roles import (
    AwaitKvCall,
    CancelKvCall,
    GenerateCall,
    KvDestination,
    KvInSpec,
    PrepareKvCall,
    PrepareKvResult,
    RoleContext,
    SendKvCall,
    SendKvResult,
)
from tests.roles.fake_engine import FakeEngine, next_token

SLOT = 256  # bytes of one fake KV block
BS = 4  # tokens per block
GIB = 1 << 30


def worker(wid: str, role: str, slots: int, **kw) -> WorkerConfig:
    return WorkerConfig(id=wid, role=role, kv_staging_gib=slots * SLOT / GIB, **kw)


class Topo:
    """P (inproc + TCP senders), RLD (inproc receiver), MD (TCP receiver, DRC of 64 blocks)."""

    def __init__(self, p_lease_s: float = 30.0, p_faults: FaultsConfig | None = None) -> None:
        self.workers = {
            "p": worker(
                "p", "prefill", 32, kv_stage_lease_s=p_lease_s, faults=p_faults or FaultsConfig()
            ),  # fmt: skip
            "rld": worker("rld", "relay_decode", 32, kv_transport="inproc"),
            "md": worker("md", "main_decode", 16),
        }
        self.cfg = PddConfig(
            cache=CacheConfig(host_capacity_gib=64 * SLOT / GIB),
            transfer=TransferConfig(deadline_s=10.0),
            workers=list(self.workers.values()),
        )
        specs = {
            "p": PlaneSpec("kv_producer", 32, None, ("inproc", "tcp")),
            "rld": RelayDecodeRole.plane_spec(self.workers["rld"], SLOT, self.cfg),
            "md": MainDecodeRole.plane_spec(self.workers["md"], SLOT, self.cfg),
        }
        classes = {"p": PrefillRole, "rld": RelayDecodeRole, "md": MainDecodeRole}
        self.planes, self.engines, self.roles = {}, {}, {}
        for wid, spec in specs.items():
            plane = KvPlane(spec, SLOT, self.workers[wid], self.cfg.transfer)
            engine = FakeEngine(plane.arena, plane.fences.board, BS)
            ctx = RoleContext(engine, plane, self.workers[wid], self.cfg, BS, SLOT)
            self.planes[wid], self.engines[wid] = plane, engine
            self.roles[wid] = classes[wid](ctx)

    async def __aenter__(self) -> Topo:
        for role in self.roles.values():
            await role.start()
        return self

    async def __aexit__(self, *exc) -> None:
        for wid, role in self.roles.items():
            await role.stop()
            await self.planes[wid].stop()

    async def generate(self, wid, rid, prompt, n, *, stage=False, source=None, kv_id=None):
        kv = KvInSpec(source, kv_id or rid, 5.0) if source else None
        call = GenerateCall(rid, list(prompt), SamplingSpec(temperature=0, max_tokens=n), stage, kv)
        async with aclosing(self.roles[wid].generate(call)) as stream:
            return [out async for out in stream]

    async def idle(self, timeout_s: float = 5.0) -> dict:
        """Poll until no role pins a slot or has an open transfer; returns the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = {w: r.kv_stats() for w, r in self.roles.items()}
            if all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values()):
                return stats
            if time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.01)


def oracle(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def toks(outs) -> list[int]:
    return [t for o in outs for t in o.delta.token_ids]


async def prepare(topo: Topo, wid: str, rid: str, prompt: list[int]) -> PrepareKvResult:
    call = PrepareKvCall(kv_request_id=rid, prompt=tuple(prompt), lease_s=30)
    return await topo.roles[wid].prepare_kv(call)


async def send(topo: Topo, rid: str, dests) -> SendKvResult:
    msg = SendKvCall(
        kv_request_id=rid,
        destinations=tuple(KvDestination(peer=a, first_block=f) for a, f in dests),
        deadline_s=10,
    )
    return await topo.roles["p"].send_kv(msg)


async def turn(topo: Topo, rid: str, prompt: list[int], k: int, m: int) -> dict:
    rld_prep = await prepare(topo, "rld", rid, prompt)
    md_prep = await prepare(topo, "md", rid, prompt)
    p = await topo.generate("p", rid, prompt, 1, stage=True)
    sent = await send(topo, rid, [(rld_prep.address, 0), (md_prep.address, md_prep.cached_blocks)])
    rld = await topo.generate("rld", rid, prompt + toks(p), k - 1, source="transfer")
    emitted = toks(p) + toks(rld)
    done = await topo.roles["md"].await_kv(AwaitKvCall(kv_request_id=rid, timeout_s=5))
    md = await topo.generate("md", rid, prompt + emitted, m, source="drc")
    return {"p": p, "sent": sent, "rld": rld, "md": md, "await": done,
            "md_prep": md_prep, "tokens": emitted + toks(md)}  # fmt: skip


def test_a_pdd_request_loads_every_block_and_matches_one_engine() -> None:
    prompt = list(range(100, 118))  # 4 whole blocks + 2 tokens

    async def scenario():
        async with Topo() as topo:
            t = await turn(topo, "r1", prompt, k=3, m=5)
            deadline = asyncio.get_running_loop().time() + 10
            while topo.roles["md"].drc.stats().committed_blocks < 6:  # MD stores its own
                assert asyncio.get_running_loop().time() < deadline, "MD never stored its own"
                await asyncio.sleep(0.005)
            return t, topo.engines["rld"].loads, topo.engines["md"].loads, await topo.idle()

    t, rld_loads, md_loads, stats = asyncio.run(scenario())
    assert t["tokens"] == oracle(prompt, 8)
    assert t["p"][-1].staged_blocks == 4
    assert list(t["sent"].bytes_per_destination) == [4 * SLOT, 4 * SLOT]
    assert rld_loads == [("r1", 4, True)] and md_loads == [("r1", 4, True)]
    assert (t["rld"][0].loaded_tokens, t["rld"][-1].loaded_tokens) == (16, 16)
    assert t["md"][0].loaded_tokens == 16
    assert (t["await"].state, t["await"].blocks_ready, t["await"].bytes_received) == (
        "done", 4, 4 * SLOT,
    )  # fmt: skip
    assert all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values())
    assert stats["md"].drc.committed_blocks == 6  # 4 landed + 2 MD stored of its own


def test_the_next_turn_sends_only_what_the_drc_lacks() -> None:
    first = list(range(100, 118))

    async def scenario():
        async with Topo() as topo:
            t1 = await turn(topo, "c1", first, k=3, m=5)
            # No wait: PrepareKv of the next turn waits for MD's own blocks of this one.
            second = first + t1["tokens"] + [7, 8, 9]  # 29 tokens: 7 whole blocks
            t2 = await turn(topo, "c2", second, k=2, m=2)
            return second, t2, topo.engines["md"].loads, await topo.idle()

    second, t2, md_loads, stats = asyncio.run(scenario())
    assert t2["tokens"] == oracle(second, 4)
    assert t2["md_prep"].cached_blocks == 6  # (18 + 8 - 1) // 4: the whole first turn
    assert list(t2["sent"].bytes_per_destination) == [7 * SLOT, 1 * SLOT]
    assert md_loads[-1] == ("c2", 7, True)
    assert stats["md"].drc_hit_tokens == 6 * BS
    assert all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values())


def test_staged_blocks_are_released_when_the_lease_expires() -> None:
    async def scenario():
        async with Topo(p_lease_s=0.2) as topo:
            outs = await topo.generate("p", "l1", list(range(12)), 1, stage=True)
            held = topo.roles["p"].kv_stats().pinned_slots
            stats = await topo.idle()
            with pytest.raises(CacheError, match="no staged KV"):
                await send(topo, "l1", [])
            return outs[-1].staged_blocks, held, stats["p"].pinned_slots

    assert asyncio.run(scenario()) == (3, 3, 0)


def test_an_aborted_stage_is_released_once_the_engine_posts_its_fence() -> None:
    async def scenario():
        async with Topo() as topo:
            call = GenerateCall("a1", list(range(20)), SamplingSpec(max_tokens=50), True)
            stream = topo.roles["p"].generate(call)
            await anext(stream)
            await stream.aclose()  # the client went away mid-request
            held = topo.roles["p"].kv_stats().pinned_slots
            return held, (await topo.idle())["p"].pinned_slots

    held, left = asyncio.run(scenario())
    assert (held, left) == (5, 0)  # held until the fence, then released


def test_a_full_staging_arena_refuses_the_request() -> None:
    """Full now: busy (429, retry); larger than the whole arena: a 400 naming the limit."""

    async def scenario():
        async with Topo() as topo:
            call = GenerateCall("a", list(range(20 * BS)), SamplingSpec(max_tokens=50), True)
            stream = topo.roles["p"].generate(call)
            await anext(stream)  # 20 of the 32 slots held while it runs
            with pytest.raises(OverloadedError, match="staging arena full"):
                await topo.generate("p", "b", list(range(13 * BS)), 1, stage=True)
            await stream.aclose()
            with pytest.raises(ContextLengthError) as never:
                await topo.generate("p", "big", list(range(33 * BS)), 1, stage=True)
            return never.value, (await topo.idle())["p"].pinned_slots

    never, left = asyncio.run(scenario())
    assert (never.status_code, never.param, left) == (400, "prompt", 0)
    assert "needs 33 KV blocks; this prefill worker's staging arena holds 32" in never.message


def test_cancel_releases_p_and_the_receivers() -> None:
    prompt = list(range(200, 240))  # 10 blocks

    async def scenario():
        async with Topo() as topo:
            rld_prep = await prepare(topo, "rld", "x1", prompt)
            md_prep = await prepare(topo, "md", "x1", prompt)
            await topo.generate("p", "x1", prompt, 1, stage=True)
            await send(topo, "x1", [(rld_prep.address, 0), (md_prep.address, 0)])
            cancel = CancelKvCall(kv_request_id="x1", reason="test")
            found = [(await topo.roles[w].cancel_kv(cancel)).found for w in ("p", "rld", "md")]
            stats = await topo.idle()
            req = AwaitKvCall(kv_request_id="x1", timeout_s=1)
            states = [(await topo.roles[w].await_kv(req)).state for w in ("rld", "md")]
            return found, stats, states

    found, stats, states = asyncio.run(scenario())
    assert found == [True, True, True]
    assert all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values())
    assert all(state in ("cancelled", "done", "failed") for state in states)


def test_a_cancel_that_beats_its_generate_to_p_stages_nothing() -> None:
    """A streamed send's router may give P's KV up before P's Generate got there: the Generate
    still runs, stages nothing (0 staged blocks) and holds no slot after it; a SendKv for it
    is refused."""
    prompt = list(range(300, 340))  # 10 blocks

    async def scenario():
        async with Topo() as topo:
            cancel = CancelKvCall(kv_request_id="c1", reason="nothing to send")
            found = (await topo.roles["p"].cancel_kv(cancel)).found
            outs = await topo.generate("p", "c1", prompt, 1, stage=True)
            stats = await topo.idle()
            with pytest.raises(CacheError, match="no staged KV"):
                await send(topo, "c1", [])
            return found, outs[-1].staged_blocks, toks(outs), stats["p"]

    found, staged, tokens, p = asyncio.run(scenario())
    assert (found, staged, tokens) == (False, 0, oracle(prompt, 1))
    assert (p.pinned_slots, p.open_transfers) == (0, 0)


def test_a_background_cancel_lets_md_s_kv_land_and_releases_everything_after() -> None:
    """RLD ended the request before MD's KV landed: CancelKv(background) on P and MD. The
    transfer goes on (deferred on P's link), MD's DRC gets every block although no Generate
    reads them, and P's staging and MD's reservation are released by themselves."""
    prompt = list(range(500, 540))  # 10 blocks

    async def scenario():
        async with Topo() as topo:
            md_prep = await prepare(topo, "md", "d1", prompt)
            await topo.generate("p", "d1", prompt, 1, stage=True)
            await send(topo, "d1", [(md_prep.address, 0)])
            keep = CancelKvCall(kv_request_id="d1", reason="rld_finished", background=True)
            found = [(await topo.roles[w].cancel_kv(keep)).found for w in ("p", "md")]
            stats = await topo.idle()
            nxt = await prepare(topo, "md", "d2", prompt + [1, 2, 3, 4])
            await topo.roles["md"].cancel_kv(CancelKvCall(kv_request_id="d2"))
            state = await topo.roles["md"].await_kv(AwaitKvCall(kv_request_id="d1", timeout_s=1))
            return found, stats, nxt.cached_blocks, state.state

    found, stats, cached, state = asyncio.run(scenario())
    assert found == [True, True]
    assert all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values())
    assert (cached, state) == (10, "done")


def test_md_commits_each_block_as_it_arrives_not_when_the_transfer_ends() -> None:
    """Partial landing through the worker's own KV plane: P holds chunk 5 of a 10-block send
    back for 3 s; meanwhile MD's DRC already holds blocks 0-4 (what a cancelled or cut
    transfer leaves, and what the next turn finds cached), and no block after the gap."""
    prompt = list(range(600, 640))  # 10 blocks
    held = FaultsConfig(kv_send=[KvChunkFault(action="delay", chunks=[5], delay_s=3.0)])

    async def scenario():
        async with Topo(p_faults=held) as topo:
            md = topo.roles["md"]
            md_prep = await prepare(topo, "md", "pl", prompt)
            await topo.generate("p", "pl", prompt, 1, stage=True)
            await send(topo, "pl", [(md_prep.address, 0)])
            chain = md.hashes(prompt, "")
            deadline = time.monotonic() + 2.0
            while md.drc.match(chain).cached_blocks < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            early = md.drc.match(chain).cached_blocks
            await topo.idle()
            return early, md.drc.match(chain).cached_blocks

    assert asyncio.run(scenario()) == (5, 10)


def test_a_full_staging_arena_gives_a_deferred_send_up_for_a_new_request() -> None:
    """P's arena (32 slots) holds a deferred send of 20 blocks that is going nowhere (its
    receiver never reads): P reports those slots as free, and a new 20-block request is
    staged at once, the deferred send cancelled to make room, instead of a 429."""
    import socket

    from pdd.worker.roles import KvAddress

    sink = socket.create_server(("127.0.0.1", 0))  # accepts no connection, reads nothing
    nowhere = KvAddress("tcp", "127.0.0.1", sink.getsockname()[1])

    async def scenario():
        async with Topo() as topo:
            p = topo.roles["p"]
            await topo.generate("p", "old", list(range(20 * BS)), 1, stage=True)
            await send(topo, "old", [(nowhere, 0)])
            keep = CancelKvCall(kv_request_id="old", reason="rld_finished", background=True)
            assert (await p.cancel_kv(keep)).found
            during = p.kv_stats()
            await topo.generate("p", "new", list(range(100, 100 + 20 * BS)), 1, stage=True)
            await p.cancel_kv(CancelKvCall(kv_request_id="new"))
            return during, await topo.idle()

    try:
        during, stats = asyncio.run(scenario())
    finally:
        sink.close()
    assert (during.pinned_slots, during.free_blocks) == (20, 32)
    assert all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values())


def test_rld_keeps_slots_a_running_generate_reads_even_after_cancel() -> None:
    prompt = list(range(300, 316))  # 4 blocks

    async def scenario():
        async with Topo() as topo:
            prep = await prepare(topo, "rld", "h1", prompt)
            await topo.generate("p", "h1", prompt, 1, stage=True)
            await send(topo, "h1", [(prep.address, 0)])
            gate = topo.engines["rld"].gate = asyncio.Event()
            kv = KvInSpec("transfer", "h1", 5.0)
            call = GenerateCall("h1", prompt, SamplingSpec(max_tokens=3), False, kv)
            task = asyncio.ensure_future(_drain(topo.roles["rld"].generate(call)))
            while not topo.engines["rld"].loads:
                await asyncio.sleep(0.005)
            await topo.roles["rld"].cancel_kv(CancelKvCall(kv_request_id="h1"))
            during = topo.roles["rld"].kv_stats().pinned_slots
            gate.set()
            await task
            return during, (await topo.idle())["rld"].pinned_slots

    assert asyncio.run(scenario()) == (4, 0)


def test_md_refuses_kv_it_did_not_reserve() -> None:
    prompt = list(range(400, 412))

    async def scenario():
        async with Topo() as topo:
            await topo.generate("p", "n1", prompt, 1, stage=True)
            addr = topo.planes["md"].address()
            await send(topo, "n1", [(addr, 0)])
            stats = await topo.idle()
            req = AwaitKvCall(kv_request_id="n1", timeout_s=0.1)
            return stats, (await topo.roles["md"].await_kv(req)).state

    stats, state = asyncio.run(scenario())
    assert all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values())
    assert stats["md"].drc.committed_blocks == 0
    assert state == "unknown"


def test_a_keyed_rld_takes_kv_only_from_the_p_given_its_landing_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With fleet credentials RLD keys every landing (as MD keys its reservations): P's chunks
    carry ``kv_id#key``; a wrong key, or KV for a request nobody prepared, is refused, and RLD's
    log says why (P hears only the ack), without the key."""
    from pdd.transfer.ucx_auth import set_kv_token

    prompt = list(range(500, 516))  # 4 blocks

    async def keyed_send(topo, rid, addr, key):
        dest = KvDestination(peer=addr, first_block=0, landing_key=key)
        msg = SendKvCall(kv_request_id=rid, destinations=(dest,), deadline_s=10)
        await topo.roles["p"].send_kv(msg)
        req = AwaitKvCall(kv_request_id=rid, timeout_s=5)
        return (await topo.roles["rld"].await_kv(req)).state

    async def scenario():
        async with Topo() as topo:
            rld = topo.roles["rld"]
            states = {}
            for rid, key in (("k1", None), ("k2", "A" * 12), ("k3", "")):
                prep = await prepare(topo, "rld", rid, prompt)
                assert len(prep.landing_key) == 12
                await topo.generate("p", rid, prompt, 1, stage=True)
                key = prep.landing_key if key is None else key  # None: the right one
                states[rid] = await keyed_send(topo, rid, prep.address, key)
            await topo.generate("p", "k4", prompt, 1, stage=True)  # no PrepareKv on RLD
            states["k4"] = await keyed_send(topo, "k4", topo.planes["rld"].address(), "")
            for rid in ("k1", "k2", "k3"):
                await rld.cancel_kv(CancelKvCall(kv_request_id=rid))
            return states, rld.kv_stats().kv_refused_chunks, await topo.idle()

    set_kv_token(b"fleet-token-for-this-test")
    try:
        with caplog.at_level("WARNING", logger="pdd.worker.kv_plane"):
            states, refused, stats = asyncio.run(scenario())
    finally:
        set_kv_token(None)
    failed = [r.getMessage() for r in caplog.records if r.name == "pdd.worker.kv_plane"]
    assert any(
        m.startswith("inbound KV of k4 failed after 0 chunks (0 bytes): ")
        and m.endswith("no landing prepared for the KV of 'k4'")
        for m in failed
    ), failed
    assert not any("#" in m or "A" * 12 in m for m in failed), failed
    assert states["k1"] == "done"  # the key the router handed to P
    assert states["k2"] != "done" and states["k3"] != "done" and states["k4"] != "done"
    assert refused >= 3
    assert all((s.pinned_slots, s.open_transfers) == (0, 0) for s in stats.values())


async def _drain(stream) -> list:
    async with aclosing(stream):
        return [out async for out in stream]
