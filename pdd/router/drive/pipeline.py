"""Pipeline drivers: how one routed request runs across workers.

A driver turns a ``GenerationRequest`` plus the routing ``Decision`` into one ordered stream of
``TokenEvent``s, and writes what it did into the request's ``PddTrace``; the service does
everything else (text, stop strings, records, metrics). One driver per ``Pipeline``:

    colocated  ColocatedPipeline: one worker prefills and decodes.
    p_md       PddPipeline: prefill on P, decode on MD (pdd.router.drive.pdd_pipeline).
    p_rld_md   PddPipeline: prefill on P, eager tokens from RLD, handoff to MD.
    pd         PdPipeline: the pd_wan / pd_local baselines (P, then D gets every block).

Contract for every driver: ``run`` is an async generator; the stream never repeats or skips a
token; closing it early (``aclose`` or task cancellation) releases everything it holds on
every worker (gRPC streams cancelled, Abort sent, CancelKv for KV), and it counts its load
with ``pool.track`` for exactly as long as a worker holds the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Protocol

from pdd.config.router import PddPolicyConfig
from pdd.errors import UnavailableError
from pdd.protocol import Pipeline, Role, RouterMode
from pdd.router.decide.view import Decision
from pdd.router.drive.pdd_pipeline import PddPipeline, PdPipeline
from pdd.router.fleet.pool import WorkerPool
from pdd.router.record import PddTrace
from pdd.router.types import GenerationRequest, TokenEvent


class PipelineDriver(Protocol):
    kind: Pipeline

    def run(
        self, req: GenerationRequest, decision: Decision, trace: PddTrace
    ) -> AsyncIterator[TokenEvent]:
        """Stream the request's token events; see the module docstring for the contract."""
        ...


class ColocatedPipeline:
    """One colocated worker does the whole request."""

    kind = Pipeline.COLOCATED

    def __init__(self, pool: WorkerPool):
        self._pool = pool

    async def run(
        self, req: GenerationRequest, decision: Decision, trace: PddTrace
    ) -> AsyncIterator[TokenEvent]:
        worker_id = decision.worker(Role.COLOCATED)
        client = self._pool.client(worker_id)
        with self._pool.track(worker_id):
            try:
                async with aclosing(client.generate(req)) as events:
                    async for event in events:
                        trace.count("colocated", len(event.token_ids))
                        yield event
            except UnavailableError as exc:
                self._pool.mark_unhealthy(worker_id, exc.message)
                raise


def build_drivers(
    mode: RouterMode, pool: WorkerPool, policy: PddPolicyConfig
) -> dict[Pipeline, PipelineDriver]:
    """The drivers a router mode needs."""
    if mode is RouterMode.PDD:
        pdd = PddPipeline(pool, policy)
        drivers: dict[Pipeline, PipelineDriver] = {Pipeline.P_MD: pdd, Pipeline.P_RLD_MD: pdd}
        if policy.test_policy == "p_rld_only":  # TEST ONLY: RLD as the pd driver's decoder
            drivers[Pipeline.PD] = PdPipeline(pool, policy)
        return drivers
    if mode in (RouterMode.PD_WAN, RouterMode.PD_LOCAL):
        return {Pipeline.PD: PdPipeline(pool, policy)}
    return {Pipeline.COLOCATED: ColocatedPipeline(pool)}
