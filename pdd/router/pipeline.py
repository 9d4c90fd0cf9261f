"""Pipeline drivers: how one routed request runs across workers.

A driver turns a ``GenerationRequest`` plus the routing ``Decision`` into one ordered stream of
``TokenEvent``s; the service does everything else (text, stop strings, records, metrics).
One driver exists per ``pdd.protocol.Pipeline`` the router mode can choose:

    colocated  ColocatedPipeline: one worker prefills and decodes.
    p_md       (later) prefill on P, decode on MD.
    p_rld_md   (later) prefill on P, eager tokens from RLD, handoff to MD.

Contract for every driver: ``run`` is an async generator; the stream never repeats or skips a
token; closing it early (``aclose`` or task cancellation) releases everything it holds on
every worker (gRPC streams cancelled, Abort sent), and it counts its load with
``pool.track`` for exactly as long as a worker holds the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Protocol

from pdd.errors import ConfigError, UnavailableError
from pdd.protocol import Pipeline, Role, RouterMode
from pdd.router.pool import WorkerPool
from pdd.router.routing import Decision
from pdd.router.types import GenerationRequest, TokenEvent


class PipelineDriver(Protocol):
    kind: Pipeline

    def run(self, req: GenerationRequest, decision: Decision) -> AsyncIterator[TokenEvent]:
        """Stream the request's token events; see the module docstring for the contract."""
        ...


class ColocatedPipeline:
    """One colocated worker does the whole request."""

    kind = Pipeline.COLOCATED

    def __init__(self, pool: WorkerPool):
        self._pool = pool

    async def run(self, req: GenerationRequest, decision: Decision) -> AsyncIterator[TokenEvent]:
        worker_id = decision.worker(Role.COLOCATED)
        client = self._pool.client(worker_id)
        with self._pool.track(worker_id):
            try:
                async with aclosing(client.generate(req)) as events:
                    async for event in events:
                        yield event
            except UnavailableError as exc:
                self._pool.mark_unhealthy(worker_id, exc.message)
                raise


def build_drivers(mode: RouterMode, pool: WorkerPool) -> dict[Pipeline, PipelineDriver]:
    """The drivers a router mode needs. Raises ConfigError for modes not built yet."""
    if mode is RouterMode.COLOCATED:
        return {Pipeline.COLOCATED: ColocatedPipeline(pool)}
    raise ConfigError(f"router.mode {mode.value!r} is not implemented yet (have: colocated)")
