"""The request flow: admission -> routing -> pipeline driver -> text deltas, plus the record.

``RouterService.stream(req)`` is an async generator; everything a request acquires is
acquired inside it, so nothing leaks if it never starts, and its ``finally`` releases it all
whether the request finishes, hits a stop string, fails, or the client goes away (the API layer
closes or cancels the generator; the driver then cancels gRPC streams and aborts on workers).

Admission is a bounded count of requests in flight (``router.max_queued_requests``, 429 above).

The request's ``pdd`` summary (``record.PddTrace``) rides on the deltas: the first one (so the
API can set the ``x-pdd-pipeline`` header before streaming) and the last one (final values).

Each record goes into the ``RequestLog`` (``/debug/requests/{id}``) as soon as it is routed,
and becomes the observer of the request's scope (``pdd.observability.context``), so every
RPC the driver makes for it lands in its timeline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from pdd.config import PddConfig
from pdd.errors import OverloadedError, PddError, UnavailableError, WorkerError
from pdd.observability.context import bind_request, current_scope
from pdd.protocol import Pipeline
from pdd.router.debug import RequestLog, TimelineObserver
from pdd.router.decide.routing import Decision, RouteRequest, choose
from pdd.router.drive.pipeline import PipelineDriver, build_drivers
from pdd.router.fleet.pool import WorkerPool
from pdd.router.metrics import RouterMetrics
from pdd.router.record import RequestRecord
from pdd.router.text.output import OutputProcessor
from pdd.router.text.tokenizer import TextCodec
from pdd.router.types import GenerationRequest, OutputDelta, TokenEvent

log = logging.getLogger(__name__)


class RouterService:
    """Runs requests. Shared by all HTTP handlers; lives as long as the app."""

    def __init__(
        self,
        cfg: PddConfig,
        codec: TextCodec,
        pool: WorkerPool,
        metrics: RouterMetrics,
        requests: RequestLog,
    ):
        self._cfg = cfg
        self._requests = requests
        self._codec = codec
        self._pool = pool
        self._metrics = metrics
        self._drivers: dict[Pipeline, PipelineDriver] = build_drivers(
            cfg.router.mode, pool, cfg.router.pdd
        )
        self._in_flight = 0
        metrics.in_flight.set_function(lambda: self._in_flight)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def check_capacity(self) -> None:
        """Cheap early 429, before tokenizing. ``stream`` re-checks when it admits."""
        if self._in_flight >= self._cfg.router.max_queued_requests:
            self._metrics.rejected.labels("overloaded").inc()
            raise OverloadedError(
                f"too many requests in flight ({self._in_flight} of "
                f"{self._cfg.router.max_queued_requests}); retry later"
            )

    async def stream(self, req: GenerationRequest) -> AsyncIterator[OutputDelta]:
        """Run one request; yield its text deltas; the last one has finish_reason and usage.

        Raises OverloadedError / UnavailableError before the first delta, WorkerError (or
        another PddError) when a worker fails.
        """
        self.check_capacity()
        self._in_flight += 1
        try:
            decision = self._route(req)
            record = RequestRecord(
                req.request_id, decision, req.arrival, time.monotonic(), len(req.prompt_token_ids)
            )
            self._requests.add(record)
            _observe_rpcs(record)
            processor = OutputProcessor(self._codec, req)
            driver = self._drivers[decision.pipeline]
            first = True
            try:
                async with aclosing(driver.run(req, decision, record.trace)) as events:
                    async for event in events:
                        delta = self._process(record, processor, event)
                        if delta is None:
                            continue
                        if first or processor.finished:
                            delta = replace(delta, pdd=record.trace.summary())
                        first = False
                        yield delta
                        if processor.finished:
                            break
            except PddError as exc:
                record.error = exc.message
                raise
            finally:
                self._close_record(record, processor)
        finally:
            self._in_flight -= 1

    @staticmethod
    def _process(
        record: RequestRecord, processor: OutputProcessor, event: TokenEvent
    ) -> OutputDelta | None:
        record.on_tokens(len(event.token_ids), time.monotonic(), event.worker_id)
        if event.finish_reason == "error":
            raise WorkerError(f"worker {event.worker_id} failed the request")
        return processor.process(event)

    def _route(self, req: GenerationRequest) -> Decision:
        route = RouteRequest(
            prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.sampling.max_tokens,
            md_cached_tokens=self._pool.md_cached_tokens(req.prompt_token_ids, req.cache_salt),
            p_cached_tokens=self._pool.p_cached_tokens(req.prompt_token_ids, req.cache_salt),
            md_routed_tokens=self._pool.md_routed_tokens(req.prompt_token_ids, req.cache_salt),
            pipeline=req.pipeline,
            handoff=req.handoff,
        )
        try:
            decision = choose(self._pool.view(), route)
        except UnavailableError:
            self._metrics.rejected.labels("unavailable").inc()
            raise
        self._metrics.route_decisions.labels(decision.pipeline.value).inc()
        self._pool.note_routed(decision, req.prompt_token_ids, req.cache_salt)
        return decision

    def _close_record(self, record: RequestRecord, processor: OutputProcessor) -> None:
        if processor.finish_reason is not None:
            reason = processor.finish_reason
        else:
            reason = "error" if record.error else "abort"  # no finish: failed or client gone
        record.close(time.monotonic(), reason, processor.completion_tokens, processor.cached_tokens)
        self._metrics.observe(record)
        if self._cfg.router.log_requests:
            log.info(record.log_line())


def _observe_rpcs(record: RequestRecord) -> None:
    """Route the request's RPC observations into its timeline (binding its id if the caller
    did not, e.g. a direct use of the service)."""
    scope = current_scope()
    if scope is None or scope.request_id != record.request_id:
        scope = bind_request(record.request_id)
    scope.observer = TimelineObserver(record)
