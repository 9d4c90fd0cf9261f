"""The disaggregated drivers: ``PddPipeline`` (p_md, p_rld_md) and ``PdPipeline`` (baselines).

p_md:
    P stage (PrepareKv on MD || P.Generate(prompt, max_tokens=1, kv_stage)) -> emit t1
    -> SendKv(MD from its cached blocks) -> MD.Generate(prompt+[t1], kv_in=DRC), sent at once:
    it waits on MD for the KV, while the router follows the landing (AwaitKv, alongside)
    md_computes (recompute beats the WAN, ``policy``): no PrepareKv or SendKv to MD;
    MD.Generate(prompt, max_tokens=1) (a warm-up, its token dropped) || P stage -> emit t1
    -> MD.Generate(prompt+[t1], kv_in=DRC): the warm-up left the prompt's whole blocks in MD's
    prefix cache, so MD extends only the tail and t1. While MD waits for its KV
    (router.pdd.md_recompute), each AwaitKv poll asks again: once computing the rest is sooner
    than the rest crossing (live figures), MD's reservation is cancelled (what landed stays in
    its DRC), which wakes its Generate to compute the rest
p_rld_md:
    P stage with RLD too (RLD from block 0) -> emit t1 -> SendKv(RLD, MD)
    -> RelayHandoff (pdd.router.drive.handoff): RLD streams, MD takes over (One-Shot / Catch-Up),
       or RLD finishes first (anomaly: the WAN transfer is cancelled)
pd_wan / pd_local (the standard PD flow):
    P stage with D (a main_decode D: the blocks its DRC lacks, as vLLM's decoder pulls only
    what its prefix cache lacks; an RLD: every block) -> t1 NOT emitted
    -> D.Generate(prompt, kv_in=DRC or TRANSFER), waiting on D for the KV: D samples every token

A P lost before its token is replaced by another P (``prefill``, every pipeline); after it,
P only sends KV, and a failed send makes the destinations recompute (``PStage.send``); a
destination with no room for the KV (PrepareKv refused) is left out the same way: a full RLD
turns p_rld_md into p_md, a full MD computes the prompt itself. A last
tier lost mid-request is taken over by another worker (``RequestRun.finish_on``,
``pdd.router.decide.recovery``).

P's token ends the request right there when it is EOS / a stop token (or max_tokens is 1):
then nothing is sent and every reservation is cancelled. Failures and client disconnects
close the generator; ``RequestRun.close`` then CancelKv's every worker that may hold KV, and
each Generate stream still open is cancelled and Aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from pdd.config.router import PddPolicyConfig
from pdd.errors import PddError
from pdd.protocol import Pipeline, Role
from pdd.router.decide.policy import md_computes_rest_sooner
from pdd.router.decide.recovery import is_worker_loss, replacement
from pdd.router.decide.view import Decision
from pdd.router.drive.handoff import RelayHandoff
from pdd.router.drive.p_stage import PStage, Target
from pdd.router.drive.request_run import RequestRun
from pdd.router.fleet.pool import WorkerPool
from pdd.router.fleet.workers import KvState
from pdd.router.record import PddTrace
from pdd.router.types import GenerationRequest, TokenEvent

log = logging.getLogger(__name__)


class PddPipeline:
    """p_md and p_rld_md (the decision says which; RLD present means p_rld_md)."""

    kind = Pipeline.P_RLD_MD

    def __init__(self, pool: WorkerPool, policy: PddPolicyConfig):
        self._pool = pool
        self._policy = policy

    async def run(
        self, req: GenerationRequest, decision: Decision, trace: PddTrace
    ) -> AsyncIterator[TokenEvent]:
        run = RequestRun(self._pool, req, trace, self._policy)
        warm: asyncio.Task[None] | None = None
        try:
            md = decision.worker(Role.MAIN_DECODE)
            rld = decision.maybe_worker(Role.RELAY_DECODE)
            targets = [Target(rld, tail=True)] if rld is not None else []
            if decision.md_computes:  # no KV crosses: MD computes the prompt while P prefills
                run.kv.supersede(md)
                warm = asyncio.get_running_loop().create_task(_warm_md(run, md))
            else:
                targets.append(Target(md, from_cache=True, recorded=True))
            stage, first = await prefill(self._pool, run, decision, targets)
            out = run.stream.take(first, "p", final=first.finish_reason == "stop")
            if run.finished:
                run.kv.release("finished on P")
            yield out
            if run.finished:
                return
            sent = await stage.send()
            if rld in stage.full:  # RLD has no room for the KV: p_md (MD waits for its KV)
                rld = trace.rld = None
                trace.pipeline = Pipeline.P_MD
            trace.md_computed = decision.md_computes or md in stage.full
            if warm is not None:  # its blocks in MD's prefix cache: Generate extends tail + t1
                await warm
            if rld is None:
                sooner = None
                if self._policy.md_recompute:  # asked again while MD waits for its KV
                    sooner = _compute_sooner(self._pool, trace, md, len(req.prompt_token_ids))
                events = run.finish_on(
                    md, "md", kv_source="drc", await_kv=md in sent, lost=stage.lost,
                    compute_sooner=sooner,
                )  # fmt: skip
            else:
                handoff = RelayHandoff(
                    run, rld, md, rld_kv=rld in sent, md_kv=md in sent, md_lost=md in stage.lost
                )
                events = handoff.events()
            async for event in events:
                yield event
        finally:
            if warm is not None and not warm.done():
                warm.cancel()  # closes its Generate stream: MD aborts it
                await asyncio.gather(warm, return_exceptions=True)
            run.close()


def _compute_sooner(
    pool: WorkerPool, trace: PddTrace, md: str, prompt_tokens: int
) -> Callable[[KvState], bool]:
    """p_md waiting for its KV: whether MD computing the rest is now sooner than the rest
    crossing (``policy.md_computes_rest_sooner`` on the fleet's live figures)."""

    def sooner(state: KvState) -> bool:
        view = pool.view()
        workers = {w.id: w for w in view.workers}
        p_view, md_view = workers.get(trace.p or ""), workers.get(md)
        if p_view is None or md_view is None:
            return False
        return md_computes_rest_sooner(p_view, md_view, trace.md_cached_tokens,
                                       state.blocks_ready, state.bytes_received,
                                       prompt_tokens, view)  # fmt: skip

    return sooner


async def _warm_md(run: RequestRun, md: str) -> None:
    """``md_computes``: MD computes the prompt into its prefix cache (loading what its DRC
    holds) while P prefills; the token it samples is dropped. A failure costs only the
    overlap: MD's Generate then computes the prompt itself, or is taken over as ever."""
    req = run.stream.continuation(f"{run.kv.kv_id}.warm", max_tokens=1)
    try:
        async for _ in run.generate(md, req, kv_in=run.kv.kv_in("drc")):
            pass
    except PddError as exc:
        log.warning("request %s: MD's warm-up failed (%s); its Generate computes the prompt",
                    run.req.request_id, exc.message)  # fmt: skip


async def prefill(
    pool: WorkerPool, run: RequestRun, decision: Decision, targets: list[Target]
) -> tuple[PStage, TokenEvent]:
    """The P stage; a P lost before its token is replaced by another healthy P (the stage
    starts over under a new KV id, to fresh copies of ``targets``), until none is left: then
    the loss is raised."""
    p, tried = decision.worker(Role.PREFILL), []
    while True:
        stage = PStage(run, p, [replace(t) for t in targets], decision.block_size)
        try:
            return stage, await stage.prefill()
        except PddError as exc:
            if not is_worker_loss(exc):
                raise
            tried.append(p)
            pool.mark_unhealthy(p, exc.message)  # suspect until a good poll
            receivers = [wid for r, wid in decision.assignments if r is not Role.PREFILL]
            nxt = replacement(pool.view(), Role.PREFILL, tried, receivers)
            if nxt is None:
                raise
            log.warning(
                "request %s: prefill worker %s lost before the first token (%s); "
                "retrying on %s", run.req.request_id, p, exc.message, nxt.id,
            )  # fmt: skip
            run.kv.release(f"prefill worker {p} lost")
            run.kv.restart(len(tried))
            p = run.trace.p = nxt.id


class PdPipeline:
    """The pd_wan / pd_local baselines: P prefills, D gets what its cache lacks and emits every
    token."""

    kind = Pipeline.PD

    def __init__(self, pool: WorkerPool, policy: PddPolicyConfig):
        self._pool = pool
        self._policy = policy

    async def run(
        self, req: GenerationRequest, decision: Decision, trace: PddTrace
    ) -> AsyncIterator[TokenEvent]:
        run = RequestRun(self._pool, req, trace, self._policy)
        try:
            d = decision.decoder
            own_cache = decision.maybe_worker(Role.MAIN_DECODE) == d  # its DRC (policy)
            target = Target(d, from_cache=own_cache, recorded=True)
            # t1 is not emitted: D samples it again from the prompt
            stage, _ = await prefill(self._pool, run, decision, [target])
            sent = await stage.send()
            source = "drc" if own_cache else "transfer" if d in sent else None
            async for event in run.finish_on(d, "d", kv_source=source, await_kv=d in sent):
                yield event
        finally:
            run.close()
