"""The disaggregated drivers: ``PddPipeline`` (p_md, p_rld_md) and ``PdPipeline`` (baselines).

p_md:
    P stage (PrepareKv on MD || P.Generate(prompt, max_tokens=1, kv_stage)) -> emit t1
    -> SendKv(MD from its cached blocks) -> AwaitKv(MD) -> MD.Generate(prompt+[t1], kv_in=DRC)
p_rld_md:
    P stage with RLD too (RLD from block 0) -> emit t1 -> SendKv(RLD, MD)
    -> RelayHandoff (pdd.router.handoff): RLD streams, MD takes over (One-Shot / Catch-Up),
       or RLD finishes first (anomaly: the WAN transfer is cancelled)
pd_wan / pd_local (the standard PD flow):
    P stage with D (every block, from 0; D's cached blocks are ignored) -> t1 NOT emitted
    -> AwaitKv(D) -> D.Generate(prompt, kv_in=TRANSFER): D samples every token itself

P's token ends the request right there when it is EOS / a stop token (or max_tokens is 1):
then nothing is sent and every reservation is cancelled. Failures and client disconnects
close the generator; ``RequestRun.close`` then CancelKv's every worker that may hold KV, and
each Generate stream still open is cancelled and Aborted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdd.config.router import PddPolicyConfig
from pdd.protocol import Pipeline, Role
from pdd.router.fleet import Decision
from pdd.router.handoff import RelayHandoff
from pdd.router.p_stage import PStage, Target
from pdd.router.pool import WorkerPool
from pdd.router.record import PddTrace
from pdd.router.request_run import RequestRun
from pdd.router.types import GenerationRequest, TokenEvent


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
        try:
            p, md = decision.worker(Role.PREFILL), decision.worker(Role.MAIN_DECODE)
            rld = decision.maybe_worker(Role.RELAY_DECODE)
            targets = [Target(rld)] if rld is not None else []
            targets.append(Target(md, from_cache=True, recorded=True))
            stage = PStage(run, p, targets, decision.block_size)
            first = await stage.prefill()
            out = run.take(first, "p", final=first.finish_reason == "stop")
            if run.finished:
                run.release_kv("finished on P")
            yield out
            if run.finished:
                return
            sent = await stage.send()
            if rld is None:
                events = run.finish_on(md, "md", kv_source="drc", await_kv=md in sent)
            else:
                handoff = RelayHandoff(run, rld, md, rld_kv=rld in sent, md_kv=md in sent)
                events = handoff.events()
            async for event in events:
                yield event
        finally:
            run.close()


class PdPipeline:
    """The pd_wan / pd_local baselines: P prefills, D gets every block and emits every token."""

    kind = Pipeline.PD

    def __init__(self, pool: WorkerPool, policy: PddPolicyConfig):
        self._pool = pool
        self._policy = policy

    async def run(
        self, req: GenerationRequest, decision: Decision, trace: PddTrace
    ) -> AsyncIterator[TokenEvent]:
        run = RequestRun(self._pool, req, trace, self._policy)
        try:
            p, d = decision.worker(Role.PREFILL), decision.decoder
            stage = PStage(run, p, [Target(d, recorded=True)], decision.block_size)
            await stage.prefill()  # t1 is not emitted: D samples it again from the prompt
            sent = await stage.send()
            source = "transfer" if d in sent else None
            async for event in run.finish_on(d, "d", kv_source=source, await_kv=d in sent):
                yield event
        finally:
            run.close()
