"""P, RLD and MD as real worker processes (real vLLM, float32), driven like the router does.

    MD.PrepareKv || P.Generate(prompt, max_tokens=1, kv_stage) -> t1
    P.SendKv([RLD over UCX from block 0, MD over TCP from its cached blocks])
    RLD.Generate(prompt + [t1], kv_in=TRANSFER) -> t2..tk
    MD.AwaitKv -> done;  MD.Generate(prompt + [t1..tk], kv_in=DRC) -> the rest

The oracle is P's own greedy run of the same prompt (float32: the tiers' tokens must be equal).
Every test ends with the leak check: no pinned slot, no open transfer, nothing running.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from collections.abc import Iterator

import grpc
import psutil
import pytest

from pdd.proto import worker_pb2 as pb
from tests.roles.support import (
    BLOCK,
    Client,
    greedy,
    kv_in,
    prompt_of,
    start_workers,
    stop_workers,
    tokens,
    write_config,
)

pytestmark = pytest.mark.slow

BLOCK_BYTES = 46_080 * BLOCK  # SmolLM2-135M float32: 46,080 bytes of KV per token
STAGE_LEASE_S = 4.0
FENCE_TIMEOUT_S = 5.0
IDS = ["p", "rld", "md"]
CHUNK = 64  # P's prefill chunk (tokens a step): its blocks leave as each chunk's forward ends
P_ENGINE = {"max_model_len": 2048, "kv_cache_space_gib": 0.5, "block_size": BLOCK,
            "max_num_seqs": 4, "max_num_batched_tokens": CHUNK}  # fmt: skip


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("roles")
    # P -> MD runs zstd-encoded (a per-MD codec: transfer.wan_codec_peers, by worker id);
    # P -> RLD (UCX) stays raw. zstd is lossless: every oracle equality below holds through it.
    transfer = {"deadline_s": 30.0, "wan_codec_peers": {"md": "zstd"}}
    config = write_config(
        tmp,
        [
            {"id": "p", "role": "prefill", "kv_staging_gib": 0.15,
             "kv_stage_lease_s": STAGE_LEASE_S, "engine": P_ENGINE},
            {"id": "rld", "role": "relay_decode", "kv_staging_gib": 0.15},
            {"id": "md", "role": "main_decode", "kv_staging_gib": 0.1, "datacenter": "dc-b",
             "kv_fence_timeout_s": FENCE_TIMEOUT_S},
        ],
        transfer=transfer,
    )  # fmt: skip
    procs = start_workers(config, IDS, tmp)
    try:
        yield procs
    finally:
        codes = stop_workers(procs)
        assert codes == {wid: 0 for wid in IDS}, {w: p.tail() for w, p in procs.items()}


def run(procs: dict, scenario):
    """Run ``scenario(client)`` in a fresh loop; then every worker must be idle."""

    async def go():
        client = Client(procs)
        try:
            out = await asyncio.wait_for(scenario(client), timeout=180)
            for wid in IDS:
                s = await client.until_idle(wid)
                assert (wid, s.pinned_slots, s.open_transfers, s.running_requests) == (
                    wid, 0, 0, 0,
                )  # fmt: skip
            return out
        finally:
            await client.close()

    return asyncio.run(go())


async def p_stage(c: Client, rid: str, prompt: list[int]):
    """PrepareKv on RLD and MD while P prefills with kv_stage; returns (t1, staged, preps)."""
    preps = [
        c.stub[w].PrepareKv(
            pb.PrepareKvRequest(kv_request_id=rid, prompt_token_ids=prompt, lease_s=60), timeout=10
        )
        for w in ("rld", "md")
    ]
    resps, prep_rld, prep_md = await asyncio.gather(
        c.generate("p", rid, prompt, 1, kv_stage=True), *preps
    )
    assert resps[-1].finish_reason == "length"
    return tokens(resps), resps[-1].kv_staged_blocks, prep_rld, prep_md


async def send(c: Client, rid: str, dests: list[tuple[pb.PeerAddress, int]], tail: int = -1):
    """SendKv to ``dests`` (address, first block); dests[tail] also gets P's tail."""
    msg = pb.SendKvRequest(
        kv_request_id=rid,
        destinations=[
            pb.KvDestination(peer=a, first_block=f, tail=i == tail)
            for i, (a, f) in enumerate(dests)
        ],
        deadline_s=30,
    )
    return await c.stub["p"].SendKv(msg, timeout=10)


async def pdd_turn(c: Client, rid: str, prompt: list[int], k: int, m: int) -> dict:
    """One p_rld_md request: P -> RLD (k tokens incl. t1; its tail too, as the router asks of
    an RLD in P's own geometry) -> MD (m more)."""
    t1, staged, prep_rld, prep_md = await p_stage(c, rid, prompt)
    dests = [(prep_rld.address, 0), (prep_md.address, prep_md.cached_blocks)]
    sent = await send(c, rid, dests, tail=0)
    rld = await c.generate("rld", rid, prompt + t1, k - 1, kv_in=kv_in(pb.KvIn.TRANSFER, rid))
    emitted = t1 + tokens(rld)
    done = await c.stub["md"].AwaitKv(pb.AwaitKvRequest(kv_request_id=rid, timeout_s=30))
    md = await c.generate("md", rid, prompt + emitted, m, kv_in=kv_in(pb.KvIn.DRC, rid))
    return {
        "staged": staged, "prep_rld": prep_rld, "prep_md": prep_md, "sent": sent,
        "rld": rld, "md": md, "await": done, "tokens": emitted + tokens(md),
    }  # fmt: skip


async def oracle(c: Client, rid: str, prompt: list[int], n: int) -> list[int]:
    return tokens(await c.generate("p", rid, prompt, n))


def test_warm_kv_has_p_measure_its_link_to_md_before_any_kv_crosses(workers) -> None:
    """The first test of the module: P has sent nothing yet. The receivers' Stats give their
    KV addresses; WarmKv with both warms the TCP link to MD (UCX to RLD has nothing to ramp
    up) and, while it runs, not again; then P's Stats report that link measured, with nothing
    queued on it, and no transfer or landing ever opened."""

    async def scenario(c: Client):
        md, rld = (await c.stats("md")).kv_address, (await c.stats("rld")).kv_address
        warming = (await c.stub["p"].WarmKv(pb.WarmKvRequest(peers=[md, rld]))).warming
        again = (await c.stub["p"].WarmKv(pb.WarmKvRequest(peers=[md]))).warming
        for _ in range(100):
            links = {link.peer: link for link in (await c.stats("p")).wan_links}
            if md.name in links and links[md.name].bandwidth_bps > 0:
                break
            await asyncio.sleep(0.1)
        return md, rld, warming, again, links, (await c.stats("md")).kv_bytes_received

    md, rld, warming, again, links, received = run(workers, scenario)
    assert (md.transport, md.name, md.probes, rld.transport) == ("tcp", "md", True, "ucx")
    assert (warming, again) == (1, 0)
    assert list(links) == ["md"] and links["md"].bandwidth_bps > 0 and links["md"].rtt_s > 0
    assert links["md"].queued_bytes == 0 and received == 0  # the probe lands nothing


def test_p_rld_md_equals_a_single_engine(workers) -> None:
    """RLD gets P's tail (the block the prompt ends inside) as well as its whole blocks, and
    computes only t1; MD gets the whole blocks. Both continue exactly as one engine."""
    prompt = prompt_of(1, 300)  # 9 whole blocks + a 12-token tail

    async def scenario(c: Client):
        turn = await pdd_turn(c, "r1", prompt, k=6, m=10)
        return turn, await oracle(c, "r1-oracle", prompt, 16)

    turn, want = run(workers, scenario)
    assert turn["tokens"] == want
    assert turn["staged"] == 9
    assert (turn["prep_rld"].cached_blocks, turn["prep_rld"].reserved_blocks) == (0, 10)
    assert turn["prep_rld"].address.transport == "ucx"
    assert (turn["prep_md"].cached_blocks, turn["prep_md"].reserved_blocks) == (0, 9)
    assert turn["prep_md"].address.transport == "tcp"
    assert list(turn["sent"].bytes_per_destination) == [10 * BLOCK_BYTES, 9 * BLOCK_BYTES]
    assert turn["rld"][0].kv_loaded_tokens == 300  # RLD loaded the whole prompt, tail too
    assert turn["rld"][-1].kv_loaded_tokens == 300  # ... as the connector confirmed
    assert (turn["await"].state, turn["await"].blocks_ready) == ("done", 9)
    assert turn["await"].bytes_received == 9 * BLOCK_BYTES
    assert turn["md"][0].kv_loaded_tokens == 288  # MD loaded them from the DRC
    assert turn["md"][0].num_cached_tokens >= 288


def test_rld_and_md_given_only_a_reference_to_the_prompt_equal_a_single_engine(workers) -> None:
    """The prompt crosses to RLD and MD once, in PrepareKv (both answer that they keep it);
    their Generates carry only the tokens after it (prompt_ref) and continue exactly as one
    engine. A reference to a prompt a worker does not hold is refused before anything starts
    (FAILED_PRECONDITION naming prompt_ref): the router then sends that prompt whole."""
    prompt = prompt_of(7, 300)

    async def scenario(c: Client):
        t1, _, prep_rld, prep_md = await p_stage(c, "ref1", prompt)
        await send(c, "ref1", [(prep_rld.address, 0), (prep_md.address, 0)], tail=0)
        ref = pb.PromptRef(kv_request_id="ref1", tokens=len(prompt))
        rld = await c.generate("rld", "ref1", t1, 5, kv_in=kv_in(pb.KvIn.TRANSFER, "ref1"),
                               prompt_ref=ref)  # fmt: skip
        emitted = t1 + tokens(rld)
        await c.stub["md"].AwaitKv(pb.AwaitKvRequest(kv_request_id="ref1", timeout_s=30))
        md = await c.generate("md", "ref1", emitted, 10, kv_in=kv_in(pb.KvIn.DRC, "ref1"),
                              prompt_ref=ref)  # fmt: skip
        lost = pb.PromptRef(kv_request_id="never-prepared", tokens=len(prompt))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.generate("md", "ref2", emitted, 4, prompt_ref=lost)
        want = await oracle(c, "ref1-oracle", prompt, 16)
        return prep_rld, prep_md, rld, md, emitted + tokens(md), refused.value, want

    prep_rld, prep_md, rld, md, got, refused, want = run(workers, scenario)
    assert prep_rld.keeps_prompt and prep_md.keeps_prompt
    assert got == want
    assert rld[0].num_prompt_tokens == len(prompt) + 1  # the whole prompt, rebuilt on RLD
    assert md[0].kv_loaded_tokens == 288  # MD loaded P's whole blocks from its DRC
    assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert refused.details().startswith("prompt_ref:") and "never-prepared" in refused.details()


def test_md_keeps_a_catch_up_request_open_between_its_calls(workers) -> None:
    """Catch-Up as one session on MD: the first warm-up loads P's blocks from the DRC and
    computes the rest of prompt + emitted, the second only what RLD emitted since, the
    switch the rest, then decodes: exactly one engine's tokens. Between calls the session is
    open (MD's Stats count it and the calls that continued it); the switch ends it. One that
    nobody continues is ended by Abort(its id); a call to a session MD does not hold runs
    whole (same tokens)."""
    prompt = prompt_of(13, 300)  # 9 whole blocks + a 12-token tail
    keep, last = pb.Session(id="cu1", keep=True), pb.Session(id="cu1", keep=False)

    async def scenario(c: Client):
        t1, _, prep_rld, prep_md = await p_stage(c, "cu1", prompt)
        await send(c, "cu1", [(prep_rld.address, 0), (prep_md.address, 0)], tail=0)
        rld = await c.generate("rld", "cu1", prompt + t1, 19, kv_in=kv_in(pb.KvIn.TRANSFER, "cu1"))
        emitted = t1 + tokens(rld)  # 20 tokens
        await c.stub["md"].AwaitKv(pb.AwaitKvRequest(kv_request_id="cu1", timeout_s=30))
        drc = kv_in(pb.KvIn.DRC, "cu1")
        warm1 = await c.generate("md", "cu1.warm1", prompt + emitted[:8], 1, kv_in=drc,
                                 session=keep)  # fmt: skip
        await c.generate("md", "cu1.warm2", prompt + emitted[:15], 1, kv_in=drc, session=keep)
        between = await c.stats("md")
        md = await c.generate("md", "cu1", prompt + emitted, 10, kv_in=drc, session=last)
        after = await c.stats("md")
        # a session nobody continues, ended by Abort; then a call naming it runs whole
        await c.generate(
            "md", "cu2.warm1", prompt + emitted[:8], 1, session=pb.Session(id="cu2", keep=True)
        )
        ended = await c.stub["md"].Abort(pb.AbortRequest(request_id="cu2"))
        whole = await c.generate("md", "cu2", prompt + emitted, 10,
                                 session=pb.Session(id="cu2", keep=False))  # fmt: skip
        want = await oracle(c, "cu1-oracle", prompt, 30)
        return warm1, between, md, after, ended, whole, emitted, want

    warm1, between, md, after, ended, whole, emitted, want = run(workers, scenario)
    assert warm1[0].kv_loaded_tokens == 288  # the session's first call loaded P's blocks
    assert (between.md_sessions, between.md_session_turns) == (1, 1)
    assert emitted + tokens(md) == want
    assert (after.md_sessions, after.md_session_turns) == (0, 2)  # the switch continued it
    assert ended.found
    assert emitted + tokens(whole) == want


def test_p_md_with_zstd_on_the_wan_equals_none(workers) -> None:
    """p_md: P's blocks cross to MD zstd-encoded (fewer wire bytes), MD decodes them into its
    DRC, and MD's greedy tokens equal P's own run of the prompt (codec none, no transfer)."""
    prompt = prompt_of(9, 200)  # 6 whole blocks + an 8-token tail

    async def scenario(c: Client):
        before = await c.stats("p")
        t1, staged, _, prep_md = await p_stage(c, "z1", prompt)
        await c.stub["rld"].CancelKv(pb.CancelKvRequest(kv_request_id="z1"), timeout=10)
        sent = await send(c, "z1", [(prep_md.address, 0)])
        done = await c.stub["md"].AwaitKv(pb.AwaitKvRequest(kv_request_id="z1", timeout_s=30))
        after = await c.until_idle("p")  # the send's end is counted once P saw it terminal
        crossed = (after.kv_bytes_sent - before.kv_bytes_sent,
                   after.kv_wire_bytes_sent - before.kv_wire_bytes_sent)  # fmt: skip
        md = await c.generate("md", "z1", prompt + t1, 11, kv_in=kv_in(pb.KvIn.DRC, "z1"))
        want = await oracle(c, "z1-oracle", prompt, 12)
        return t1 + tokens(md), want, staged, sent, done, md, crossed

    got, want, staged, sent, done, md, (raw, wire_sent) = run(workers, scenario)
    assert got == want
    assert (staged, done.state) == (6, "done")
    assert md[0].kv_loaded_tokens == 6 * BLOCK  # MD loaded the decoded blocks from its DRC
    assert list(sent.bytes_per_destination) == [6 * BLOCK_BYTES]
    (wire,) = sent.wire_bytes_per_destination  # expected: raw x the learned zstd ratio
    assert 0 < wire < 6 * BLOCK_BYTES
    assert raw == 6 * BLOCK_BYTES and 0 < wire_sent < 0.9 * raw  # float32 KV: ~0.35 measured


def test_a_send_while_p_prefills_streams_each_chunks_blocks(workers) -> None:
    """SendKv reaches P while it still prefills (the router's ``stream_kv``): each chunk's
    blocks leave as its forward ends, so by P's token much of the prompt is on MD already;
    MD's KV is complete only once the last part landed, and its tokens equal one engine's."""
    prompt = prompt_of(11, 700)  # 21 whole blocks: 11 prefill steps of 64 tokens on P

    async def scenario(c: Client):
        prep = await c.stub["md"].PrepareKv(
            pb.PrepareKvRequest(kv_request_id="s1", prompt_token_ids=prompt, lease_s=60),
            timeout=10,
        )
        prefill = asyncio.ensure_future(c.generate("p", "s1", prompt, 1, kv_stage=True))
        sent = await send(c, "s1", [(prep.address, 0)])  # P has not finished its prefill
        resps = await prefill
        at_token = await c.stub["md"].AwaitKv(
            pb.AwaitKvRequest(kv_request_id="s1", timeout_s=0.001)
        )
        done = await c.stub["md"].AwaitKv(pb.AwaitKvRequest(kv_request_id="s1", timeout_s=30))
        t1 = tokens(resps)
        md = await c.generate("md", "s1", prompt + t1, 7, kv_in=kv_in(pb.KvIn.DRC, "s1"))
        return t1 + tokens(md), await oracle(c, "s1-oracle", prompt, 8), sent, at_token, done

    got, want, sent, at_token, done = run(workers, scenario)
    assert got == want
    assert (sent.staged_blocks, list(sent.bytes_per_destination)) == (21, [21 * BLOCK_BYTES])
    assert at_token.blocks_ready >= 1  # parts crossed while P prefilled (here: 20 of 21)
    assert (done.state, done.blocks_ready, done.bytes_received) == ("done", 21, 21 * BLOCK_BYTES)


def test_second_turn_sends_only_the_new_blocks(workers) -> None:
    first = prompt_of(2, 300)
    user = prompt_of(3, 40)

    async def scenario(c: Client):
        before = await c.stats("md")
        t1 = await pdd_turn(c, "c1", first, k=4, m=28)
        history = first + t1["tokens"]  # 332 tokens: MD computed blocks 9 (its own output)
        await until_drc_holds(c, "md", before.drc_used_blocks + (len(history) - 1) // BLOCK)
        second = history + user
        t2 = await pdd_turn(c, "c2", second, k=4, m=8)
        after = await c.stats("md")
        return t1, t2, await oracle(c, "c2-oracle", second, 12), before, after

    t1, t2, want, before, after = run(workers, scenario)
    assert t2["tokens"] == want
    cached = t2["prep_md"].cached_blocks
    assert cached >= len(first) // BLOCK  # turn 1's WAN blocks (9)
    assert cached == (len(first) + 32 - 1) // BLOCK  # + the block MD computed itself (10)
    staged = t2["staged"]
    assert staged == (len(first) + 32 + len(user)) // BLOCK  # 11
    # Only the blocks MD lacks crossed the WAN; RLD got everything, P's tail too (372 tokens).
    assert list(t2["sent"].bytes_per_destination) == [
        (staged + 1) * BLOCK_BYTES, (staged - cached) * BLOCK_BYTES,
    ]  # fmt: skip
    received = after.kv_bytes_received - before.kv_bytes_received
    assert received == (9 + staged - cached) * BLOCK_BYTES
    assert after.drc_hit_tokens - before.drc_hit_tokens == cached * BLOCK


async def until_drc_holds(c: Client, wid: str, blocks: int, timeout_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (s := await c.stats(wid)).drc_used_blocks < blocks:
        assert asyncio.get_running_loop().time() < deadline, f"DRC holds {s.drc_used_blocks}"
        await asyncio.sleep(0.05)


def test_pd_baselines_send_what_the_decoder_lacks_and_it_samples_every_token(workers) -> None:
    """pd_wan (D = MD over TCP) and pd_local (D = RLD over UCX): P's token is not used, D
    continues the prompt itself. As vLLM's decoder pulls only what its prefix cache lacks,
    MD gets the blocks its DRC lacks and loads the rest from it; RLD gets every block."""
    base = prompt_of(6, 200)
    longer = base + prompt_of(7, 70)  # shares base's 6 whole blocks

    async def pd(c: Client, rid: str, prompt: list[int], d: str) -> tuple:
        _, staged, prep_rld, prep_md = await p_stage(c, rid, prompt)
        prep = prep_md if d == "md" else prep_rld
        cancel = pb.CancelKvRequest(kv_request_id=rid, reason="not this decoder")
        await c.stub["rld" if d == "md" else "md"].CancelKv(cancel)
        first, source = (prep.cached_blocks, pb.KvIn.DRC) if d == "md" else (0, pb.KvIn.TRANSFER)
        sent = await send(c, rid, [(prep.address, first)])
        state = await c.stub[d].AwaitKv(pb.AwaitKvRequest(kv_request_id=rid, timeout_s=30))
        outs = await c.generate(d, rid, prompt, 8, kv_in=kv_in(source, rid))
        return staged, prep.cached_blocks, list(sent.bytes_per_destination), state.state, outs

    async def scenario(c: Client):
        runs = [
            await pd(c, "pd1", base, "md"),
            await pd(c, "pd2", longer, "md"),
            await pd(c, "pd3", longer, "rld"),
        ]
        wants = [await oracle(c, f"pd{i}-oracle", p, 8) for i, p in enumerate([base, longer])]
        return runs, wants, await c.stats("p")

    runs, (want_base, want_longer), p_stats = run(workers, scenario)
    (s1, c1, b1, st1, o1), (s2, c2, b2, st2, o2), (s3, c3, b3, st3, o3) = runs
    assert (s1, c1, b1, st1, tokens(o1)) == (6, 0, [6 * BLOCK_BYTES], "done", want_base)
    assert (s2, c2, b2, st2, tokens(o2)) == (8, 6, [2 * BLOCK_BYTES], "done", want_longer)
    assert (s3, c3, b3, st3, tokens(o3)) == (8, 0, [8 * BLOCK_BYTES], "done", want_longer)
    assert [o[0].kv_loaded_tokens for o in (o1, o2, o3)] == [192, 256, 256]
    assert p_stats.wan_rtt_s > 0  # P measured its TCP path to MD


def test_cancel_mid_transfer_releases_everything(workers) -> None:
    prompt = prompt_of(4, 1200)  # 37 blocks, 55 MB of float32 KV

    async def scenario(c: Client):
        _, staged, _, prep_md = await p_stage(c, "x1", prompt)
        await send(c, "x1", [(prep_md.address, 0)])
        # P first: a receiver cancelled first refuses P's next chunk, which ends P's send and
        # releases its stage before P's own CancelKv could find it (a race, not a leak)
        found = [
            await c.stub[w].CancelKv(pb.CancelKvRequest(kv_request_id="x1", reason="test"))
            for w in ("p", "rld", "md")
        ]
        state = await c.stub["md"].AwaitKv(pb.AwaitKvRequest(kv_request_id="x1", timeout_s=10))
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await send(c, "x1", [(prep_md.address, 0)])
        return staged, [f.found for f in found], state, again.value

    staged, found, state, again = run(workers, scenario)
    assert staged == 37
    assert found == [True, True, True]
    assert state.state in ("cancelled", "failed", "done")
    assert again.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no staged KV" in again.details()


def test_rld_gives_its_landing_slots_back_at_its_first_token_not_its_last(workers) -> None:
    """RLD reads its landed KV in the request's first step only, so its landing slots are
    free while it goes on decoding (another request's KV can land there); the text is the
    single engine's."""
    prompt = prompt_of(12, 300)  # 9 whole blocks

    async def scenario(c: Client):
        t1, _, prep_rld, _ = await p_stage(c, "early", prompt)
        await c.stub["md"].CancelKv(pb.CancelKvRequest(kv_request_id="early"), timeout=10)
        await send(c, "early", [(prep_rld.address, 0)])
        req = pb.GenerateRequest(
            request_id="early", prompt_token_ids=prompt + t1, sampling=greedy(48),
            kv_in=kv_in(pb.KvIn.TRANSFER, "early"),
        )  # fmt: skip
        got, during = list(t1), None
        async for resp in c.stub["rld"].Generate(req, timeout=120):
            got += resp.token_ids
            if during is None and len(got) >= 4:  # RLD is decoding
                during = await c.stats("rld")
        return got, during, await oracle(c, "early-oracle", prompt, 49)

    got, during, want = run(workers, scenario)
    assert got == want
    assert during.running_requests == 1 and during.pinned_slots == 0


def test_rld_generate_cancelled_before_its_first_delta_gives_its_slots_back(workers) -> None:
    """The One-Shot switch's cancel, right after RLD's Generate began (the unposted-fence bug,
    docs/notes/engine.md): RLD's KV landed, its Generate is cancelled 0-20 ms in, around
    its start; its landing slots must come back (the fence was posted) and it stays ready.
    The delays sweep the window where vLLM is still adding the request; which one (if any)
    hits it depends on the machine: tests/engine/test_connector.py hits it every time."""
    prompt = prompt_of(11, 200)  # 6 whole blocks + an 8-token tail

    async def scenario(c: Client):
        out = []
        for i, delay_s in enumerate((0.0, 0.002, 0.005, 0.01, 0.02)):
            rid = f"cx{i}"
            t1, _, prep_rld, _ = await p_stage(c, rid, prompt)
            await c.stub["md"].CancelKv(pb.CancelKvRequest(kv_request_id=rid), timeout=10)
            await send(c, rid, [(prep_rld.address, 0)])
            req = pb.GenerateRequest(
                request_id=rid, prompt_token_ids=prompt + t1, sampling=greedy(8),
                kv_in=kv_in(pb.KvIn.TRANSFER, rid),
            )  # fmt: skip
            call = c.stub["rld"].Generate(req, timeout=60)
            await asyncio.sleep(delay_s)
            call.cancel()
            # as the router's KvParties does on a switch: RLD's KV is no longer wanted (frees
            # a landing the cancelled Generate never took; one it took waits for its fence)
            await c.stub["rld"].CancelKv(pb.CancelKvRequest(kv_request_id=rid), timeout=10)
            idle = await c.until_idle("rld")
            health = await c.stub["rld"].Health(pb.HealthRequest(), timeout=5)
            out.append((rid, idle.pinned_slots, health.ready))
        return out

    got = run(workers, scenario)
    assert got == [(f"cx{i}", 0, True) for i in range(5)]


def test_each_worker_reports_the_kv_blocks_a_new_request_can_have(workers) -> None:
    """Stats' kv_arena_blocks / kv_free_blocks (what the router routes by): idle, all of P's
    staging and RLD's landing slots are free; a request staged on P and reserved on RLD and MD
    holds its 9 blocks on each (P and RLD: and its tail's) until it is given up, and then they
    are free again."""
    prompt = prompt_of(13, 300)  # 9 whole blocks and a tail

    async def scenario(c: Client):
        idle = {w: await c.stats(w) for w in IDS}
        _, staged, _, _ = await p_stage(c, "room", prompt)
        held = {w: await c.stats(w) for w in IDS}
        for w in IDS:
            await c.stub[w].CancelKv(pb.CancelKvRequest(kv_request_id="room", reason="test"))
        after = {w: await c.until_idle(w) for w in IDS}
        return staged, idle, held, after

    staged, idle, held, after = run(workers, scenario)
    assert staged == 9
    for w in IDS:
        arena = idle[w].kv_arena_blocks
        assert arena > 9, (w, idle[w])
        if w != "md":  # MD's DRC may hold earlier tests' blocks: evictable, so they count free
            assert idle[w].kv_free_blocks == arena, (w, idle[w])
        tail = 1 if w != "md" else 0  # P stages the tail too, and RLD makes room for it
        assert held[w].kv_free_blocks == idle[w].kv_free_blocks - 9 - tail, (w, held[w])
        assert after[w].kv_free_blocks == idle[w].kv_free_blocks, (w, after[w])


def test_staged_kv_is_released_when_its_lease_expires(workers) -> None:
    async def scenario(c: Client):
        resps = await c.generate("p", "lease1", prompt_of(5, 100), 1, kv_stage=True)
        held = await c.stats("p")
        s = await c.until_idle("p", timeout_s=STAGE_LEASE_S + 10)
        return resps[-1].kv_staged_blocks, held.pinned_slots, s.pinned_slots

    staged, held, left = run(workers, scenario)
    assert (staged, held, left) == (3, 4, 0)  # 3 whole blocks and the tail held, then none


def test_roles_refuse_what_they_do_not_serve(workers) -> None:
    async def scenario(c: Client):
        errors = []
        calls = [
            c.stub["md"].SendKv(pb.SendKvRequest(kv_request_id="u")),
            c.stub["p"].PrepareKv(pb.PrepareKvRequest(kv_request_id="u")),
            c.stub["rld"].DrcEvents(pb.DrcEventsRequest(since=-1)),
            c.generate("rld", "u", [5, 6, 7], 1, kv_stage=True),
            c.generate("p", "u", [5, 6, 7], 1, kv_in=kv_in(pb.KvIn.DRC, "u")),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            errors.append(info.value.code())
        snap = await c.stub["md"].DrcEvents(pb.DrcEventsRequest(since=-1))
        events = await c.stub["md"].DrcEvents(pb.DrcEventsRequest(since=0))
        return errors, snap, events

    errors, snap, events = run(workers, scenario)
    assert errors == [grpc.StatusCode.UNIMPLEMENTED] * 3 + [grpc.StatusCode.FAILED_PRECONDITION] * 2
    body = json.loads(snap.json)
    assert snap.snapshot and body["block_size"] == BLOCK and isinstance(body["block_hashes"], list)
    assert not events.snapshot and json.loads(events.json)["last_seq"] == body["seq"]


def test_health_endpoint_and_kv_metrics(workers) -> None:
    for wid, w in workers.items():
        with urllib.request.urlopen(f"http://{w.metrics_addr}/health", timeout=5) as resp:
            assert (resp.status, resp.read()) == (200, b"ok\n")
        body = urllib.request.urlopen(f"http://{w.metrics_addr}/metrics", timeout=5).read()
        text = body.decode()
        assert f'pdd_worker_kv_pinned_slots{{role="{_role(wid)}"}} 0.0' in text
    md = urllib.request.urlopen(f"http://{workers['md'].metrics_addr}/metrics", timeout=5)
    assert "pdd_drc_capacity_blocks" in md.read().decode()


def _role(wid: str) -> str:
    return {"p": "prefill", "rld": "relay_decode", "md": "main_decode"}[wid]


def engine_core(proc) -> psutil.Process:
    """The vLLM engine-core child of a worker process (multiprocessing's spawn child)."""
    kids = psutil.Process(proc.pid).children()
    (core,) = [k for k in kids if k.name().startswith("VLLM") or "EngineCore" in k.name()]
    return core


def test_a_stalled_engine_core_never_has_its_slots_reused(workers) -> None:
    """MD's engine core stops (SIGSTOP); a request pins the DRC blocks it is to load (the
    slots are read in its first step, which never comes) and is aborted. The abort's fence
    cannot be posted: past kv_fence_timeout_s the worker reports not ready and the pinned
    slots stay held, however long the stall (never a timed free); after SIGCONT the core
    posts the fence, the slots come back, and MD is ready again."""
    prompt = prompt_of(8, 300)
    core = engine_core(workers["md"].proc)

    async def scenario(c: Client):
        await pdd_turn(c, "st0", prompt, k=2, m=2)  # MD's DRC now holds the prompt's 9 blocks
        req = pb.GenerateRequest(
            request_id="st1", prompt_token_ids=prompt, sampling=greedy(400),
            kv_in=kv_in(pb.KvIn.DRC, "st1"),
        )  # fmt: skip
        core.send_signal(signal.SIGSTOP)
        try:
            stream = c.stub["md"].Generate(req, timeout=120)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while (pinned := (await c.stats("md")).pinned_slots) < 9:  # its 9 DRC blocks
                assert loop.time() < deadline, "MD never pinned the blocks to load"
                await asyncio.sleep(0.05)
            await c.stub["md"].Abort(pb.AbortRequest(request_id="st1"), timeout=5)
            stream.cancel()
            deadline = loop.time() + FENCE_TIMEOUT_S + 30
            while (await c.stub["md"].Health(pb.HealthRequest(), timeout=5)).ready:
                assert loop.time() < deadline, "MD never reported the stall"
                await asyncio.sleep(0.2)
            await asyncio.sleep(FENCE_TIMEOUT_S)  # twice the fence timeout: still held
            stalled = await c.stats("md")
        finally:
            core.send_signal(signal.SIGCONT)
        idle = await c.until_idle("md", timeout_s=60)
        health = await c.stub["md"].Health(pb.HealthRequest(), timeout=5)
        return pinned, stalled, idle, health

    pinned, stalled, idle, health = run(workers, scenario)
    assert pinned >= 9
    assert stalled.pinned_slots >= 9  # quarantined, not freed, after 2x the fence timeout
    assert (idle.pinned_slots, health.ready) == (0, True)
    assert idle.drc_used_blocks >= 9  # the blocks themselves stay in the DRC
