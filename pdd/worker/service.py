"""The router-facing gRPC servicer of one worker (pdd.worker.v1.Worker over grpc.aio).

Owns: request admission (validation, draining), mapping pdd errors to gRPC status codes, and the
link between a Generate stream and its engine request: when the stream ends for any reason
(finished, client cancelled, deadline, server stopping) the engine request is closed, which
aborts it if it was still running.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from pdd.config import WorkerConfig
from pdd.errors import (
    InvalidRequestError,
    OverloadedError,
    PddError,
    UnavailableError,
)
from pdd.proto import worker_pb2 as pb
from pdd.proto import worker_pb2_grpc as pb_grpc
from pdd.worker.convert import delta_to_proto, sampling_from_proto, stats_to_proto
from pdd.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from pdd.engine.engine import Engine

log = logging.getLogger(__name__)


def status_for(err: PddError) -> grpc.StatusCode:
    """The gRPC status a pdd error travels as (the router maps it back)."""
    if isinstance(err, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(err, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(err, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class WorkerService(pb_grpc.WorkerServicer):
    """Serves one Engine. ``draining`` refuses new work while the process shuts down."""

    def __init__(
        self, engine: Engine, worker: WorkerConfig, model_name: str, metrics: WorkerMetrics
    ) -> None:
        self._engine = engine
        self._worker = worker
        self._model_name = model_name
        self._metrics = metrics
        self.draining = False

    @property
    def role(self) -> str:
        return self._worker.role.value

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id
        try:
            stream = self._admit(request)
        except PddError as err:
            self._metrics.request_done(self.role, "rejected")
            await context.abort(status_for(err), err.message)
            return  # not reached: abort raises
        outcome = "error"
        try:
            async with contextlib.aclosing(stream):
                first = True
                async for delta in stream:
                    yield delta_to_proto(delta, first)
                    first = False
                    if delta.finish_reason is not None:
                        outcome = delta.finish_reason
        except PddError as err:
            outcome = "rejected" if isinstance(err, InvalidRequestError) else "error"
            log.warning("request %s failed: %s", rid, err.message)
            await context.abort(status_for(err), err.message)
        except BaseException:  # cancelled by the client or by server shutdown
            outcome = "cancelled"
            raise
        finally:
            self._metrics.request_done(self.role, outcome)

    def _admit(self, request: pb.GenerateRequest) -> AsyncIterator:
        """Validate and start the engine request. Raises PddError (nothing started then)."""
        if self.draining:
            raise UnavailableError("worker is shutting down")
        if not self._engine.ready:
            raise UnavailableError("engine is not ready")
        if not request.request_id:
            raise InvalidRequestError("request_id must not be empty", param="request_id")
        if not request.HasField("sampling"):
            raise InvalidRequestError("sampling must be set", param="sampling")
        spec = sampling_from_proto(request.sampling)
        prompt = list(request.prompt_token_ids)
        self._engine.validate(prompt, spec)
        return self._engine.generate(request.request_id, prompt, spec)

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        found = await self._engine.abort(request.request_id) if self._engine.ready else False
        return pb.AbortResponse(found=found)

    async def Health(  # noqa: N802
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        return pb.HealthResponse(
            ready=self._engine.ready and not self.draining,
            worker_id=self._worker.id,
            role=self.role,
            model=self._model_name,
        )

    async def Stats(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return stats_to_proto(self._worker.id, self.role, self._engine.stats())
