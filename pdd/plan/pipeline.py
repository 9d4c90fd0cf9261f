"""router.mode pdd as the drivers run it (pdd.router.drive.pdd_pipeline), in simulated time.

Steps of one request, after ``routing.choose`` picked the pipeline, workers and handoff:

    P prefill ──> t1 (TTFT) ──┬─ WAN: blocks MD lacks (shared link) ─> landed ──> MD
                              └─ p_rld_md: all blocks over the local link ──> RLD decodes
    p_md:      MD Generate(prompt + [t1]) after landing + one RTT: extend(tail + 1), decode;
               md_computes (router.pdd.md_recompute): no transfer; MD's warm-up prefills
               what its DRC lacks while P prefills; after t1 + one RTT MD extends tail + 1.
    p_rld_md:  RLD loads every block, P's tail too where it holds KV in P's geometry (it
               extends t1 alone); landed before RLD ends -> handoff (One-Shot | Catch-Up
               rounds), MD decodes the rest; RLD ends first -> handoff rld_finished, and
               the transfer goes on behind every other (``Simulation.defer``): MD's cache
               gets the prompt when it lands; the conversation's next request to that MD
               cuts it (``supersede``), MD keeping the blocks that crossed.
    end:       MD's DRC stores prompt + answer (what MD re-exports when a request ends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdd.plan.servers import Seq
from pdd.plan.workload import Turn
from pdd.protocol import HandoffMode, Role

if TYPE_CHECKING:
    from pdd.plan.sim import Record, Simulation, Worker


def run_pdd(sim: Simulation, conv: int, turn: Turn, rec: Record):  # noqa: ANN201 (simpy)
    d = rec.decision
    p, md = sim.workers[d.worker(Role.PREFILL)], sim.workers[d.worker(Role.MAIN_DECODE)]
    rld_id = d.maybe_worker(Role.RELAY_DECODE)
    env, n, out = sim.env, turn.prompt_tokens, turn.output_tokens
    sim.supersede(md, conv)
    if d.md_computes:
        yield from _md_computes(sim, p, md, conv, turn, rec)
        return
    yield from sim.prefill_stage(p, conv, turn, rec)
    rec.first_at = env.now  # P's token is emitted at once
    sim.release(rec, p)
    assert md.cache is not None and md.decode is not None
    bs, kvb = md.profile.block_size, md.profile.kv_bytes_per_token
    have = md.cache.cached_tokens(conv, n)  # what MD holds when the send starts
    nbytes = (n // bs * bs - have) * kvb
    transfer = sim.link.send(nbytes)
    tail = n % bs
    if rld_id is None or out <= 1:
        yield transfer.landed
        rec.wan_bytes = nbytes
        pin = land(md, conv, n)
        yield env.timeout(sim.wan.rtt_s)  # the router's Generate reaches MD
        yield from sim.decode(md, n + 1, out - 1, md.profile.extend_s(tail + 1))
        finish(md, conv, n + out, pin)
        return
    rld = sim.workers[rld_id]
    assert rld.decode is not None
    yield env.timeout(sim.local_s(n * p.profile.kv_bytes_per_token))
    seq = Seq(float(out - 1), n + 1, env.event())
    same = (rld.profile.block_size, rld.profile.kv_bytes_per_token) == (
        p.profile.block_size, p.profile.kv_bytes_per_token)  # fmt: skip
    rld.decode.add(seq, rld.profile.extend_s(1 if same else tail + 1))  # P's tail: KvDestination
    yield transfer.landed | seq.done
    if seq.done.triggered:  # RLD finished before MD's KV: the rest crosses in the background
        rec.wan_bytes = int(transfer.sent)
        rec.rld_tokens = out - 1
        rec.handoff = HandoffMode.RLD_FINISHED.value
        sim.release(rec, rld)
        sim.defer(md, conv, have, n, transfer, rec)
        return
    rec.wan_bytes = nbytes
    pin = land(md, conv, n)
    yield env.timeout(sim.wan.rtt_s)
    known = 0
    if d.handoff is HandoffMode.CATCH_UP:
        known = yield from _catch_up(sim, rld, md, seq, rec)
    emitted = rld.decode.remove(seq) if not seq.done.triggered else out - 1
    sim.release(rec, rld)
    rec.rld_tokens = emitted
    rec.handoff = d.handoff.value
    left = out - 1 - emitted
    extend = md.profile.extend_s(tail + 1 + emitted - known)
    yield from sim.decode(md, n + 1 + emitted, left, extend)
    finish(md, conv, n + out, pin)


def _md_computes(sim: Simulation, p: Worker, md: Worker, conv: int, turn: Turn, rec: Record):  # noqa: ANN202
    """Nothing crosses: MD's warm-up computes the prompt (what its DRC lacks) while P
    prefills, stalling MD's batch as it runs; after P's token MD extends the tail and t1."""
    env, n, out = sim.env, turn.prompt_tokens, turn.output_tokens
    assert md.cache is not None and md.decode is not None
    have = md.cache.cached_tokens(conv, n)
    pin = md.cache.pin(conv, have)
    seconds = md.profile.prefill_s(n - have, have)
    warm_end = env.now + sim.wan.rtt_s / 2 + seconds  # the warm-up reaches MD, then runs
    md.decode.add_extra(seconds)
    yield from sim.prefill_stage(p, conv, turn, rec)
    rec.first_at = env.now
    sim.release(rec, p)
    yield env.timeout(max(sim.wan.rtt_s, warm_end - env.now))  # and MD's Generate reaches it
    tail = n % md.profile.block_size
    yield from sim.decode(md, n + 1, out - 1, md.profile.extend_s(tail + 1))
    finish(md, conv, n + out, pin)


def _catch_up(sim: Simulation, rld: Worker, md: Worker, seq: Seq, rec: Record):  # noqa: ANN202
    """MD warms up on what RLD emitted while RLD goes on; returns the tokens MD has."""
    policy, known = sim.settings.policy, 0
    assert rld.decode is not None and md.decode is not None
    for rounds in range(policy.max_catch_up_rounds):
        rld.decode.advance()
        gap = int(rld.decode.generated(seq)) - known
        small = gap < policy.catch_up_threshold_tokens and rounds >= policy.min_catch_up_rounds
        if small or gap <= 0 or seq.done.triggered:
            break
        seconds = md.profile.extend_s(gap)
        md.decode.add_extra(seconds)  # the warm-up forward shares MD's batch
        known += gap
        yield sim.env.timeout(seconds + sim.wan.rtt_s)
    return known


def land(md: Worker, conv: int, tokens: int) -> object:
    """The WAN blocks committed into MD's DRC; the request's lease pins its prefix."""
    assert md.cache is not None
    md.cache.store(conv, tokens)
    return md.cache.pin(conv, tokens)


def finish(md: Worker, conv: int, tokens: int, pin: object) -> None:
    assert md.cache is not None
    md.cache.unpin(pin)
    md.cache.store(conv, tokens)
