"""The router-facing gRPC servicer of one worker (pdd.worker.v1.Worker over grpc.aio).

Owns: request admission (validation, draining, what the role supports), mapping pdd errors to
gRPC status codes, and the link between a Generate stream and its engine request: when the
stream ends for any reason (finished, client cancelled, deadline, server stopping) the role's
generator is closed, which aborts the engine request if it was still running and releases
whatever KV the role held for it.

KV RPCs (SendKv, PrepareKv, AwaitKv, CancelKv, DrcEvents) go to the role policy when it
supports them, else UNIMPLEMENTED; a Generate asking for ``kv_stage`` / ``kv_in`` a role cannot
honour is FAILED_PRECONDITION.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from pdd.config import WorkerConfig
from pdd.errors import (
    CacheError,
    InvalidRequestError,
    OverloadedError,
    PddError,
    UnavailableError,
)
from pdd.proto import worker_pb2 as pb
from pdd.proto import worker_pb2_grpc as pb_grpc
from pdd.worker.convert import (
    call_from_proto,
    kv_delta_to_proto,
    sampling_from_proto,
    stats_to_proto,
)
from pdd.worker.metrics import WorkerMetrics
from pdd.worker.roles import KV_IN, KV_STAGE, GenerateCall, RolePolicy

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
    if isinstance(err, CacheError):  # unknown / released KV of a request
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class WorkerService(pb_grpc.WorkerServicer):
    """Serves one Engine through one role. ``draining`` refuses new work at shutdown."""

    def __init__(
        self,
        engine: Engine,
        worker: WorkerConfig,
        model_name: str,
        metrics: WorkerMetrics,
        role: RolePolicy,
    ) -> None:
        self._engine = engine
        self._worker = worker
        self._model_name = model_name
        self._metrics = metrics
        self._role = role
        self.draining = False

    @property
    def role(self) -> str:
        return self._worker.role.value

    @property
    def ready(self) -> bool:
        return self._engine.ready and not self.draining

    # --- Generate -------------------------------------------------------------------------

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id
        try:
            call = self._admit(request)
        except PddError as err:
            self._metrics.request_done(self.role, "rejected")
            await context.abort(status_for(err), err.message)
            return  # not reached: abort raises
        except _Refused as ref:
            self._metrics.request_done(self.role, "rejected")
            await context.abort(ref.code, ref.message)
            return
        outcome = "error"
        try:
            async with contextlib.aclosing(self._role.generate(call)) as stream:
                first = True
                async for out in stream:
                    yield kv_delta_to_proto(out, first)
                    first = False
                    if out.delta.finish_reason is not None:
                        outcome = out.delta.finish_reason
        except PddError as err:
            outcome = (
                "rejected" if isinstance(err, InvalidRequestError | OverloadedError) else "error"
            )
            log.warning("request %s failed: %s", rid, err.message)
            await context.abort(status_for(err), err.message)
        except BaseException:  # cancelled by the client or by server shutdown
            outcome = "cancelled"
            raise
        finally:
            self._metrics.request_done(self.role, outcome)

    def _admit(self, request: pb.GenerateRequest) -> GenerateCall:
        """Validate the request. Raises PddError or _Refused (nothing started then)."""
        self._require_ready()
        if not request.request_id:
            raise InvalidRequestError("request_id must not be empty", param="request_id")
        if not request.HasField("sampling"):
            raise InvalidRequestError("sampling must be set", param="sampling")
        spec = sampling_from_proto(request.sampling)
        call = call_from_proto(request, spec)
        for wanted, feature in ((call.kv_stage, KV_STAGE), (call.kv_in is not None, KV_IN)):
            if wanted and feature not in self._role.supports:
                raise _Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"worker {self._worker.id} (role {self.role}) cannot serve {feature}",
                )
        self._engine.validate(call.prompt, spec)
        return call

    def _require_ready(self) -> None:
        if self.draining:
            raise UnavailableError("worker is shutting down")
        if not self._engine.ready:
            raise UnavailableError("engine is not ready")

    # --- KV plane -------------------------------------------------------------------------

    async def _kv(self, name: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if name not in self._role.supports:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"worker {self._worker.id} (role {self.role}) does not serve {name}",
            )
        try:
            self._require_ready()
            return await getattr(self._role, _snake(name))(request)
        except PddError as err:
            log.info("%s failed: %s", name, err.message)
            await context.abort(status_for(err), err.message)

    async def SendKv(self, request: pb.SendKvRequest, context) -> pb.SendKvResponse:  # noqa: N802
        return await self._kv("SendKv", request, context)

    async def PrepareKv(self, request: pb.PrepareKvRequest, context) -> pb.PrepareKvResponse:  # noqa: N802
        return await self._kv("PrepareKv", request, context)

    async def AwaitKv(self, request: pb.AwaitKvRequest, context) -> pb.AwaitKvResponse:  # noqa: N802
        return await self._kv("AwaitKv", request, context)

    async def CancelKv(self, request: pb.CancelKvRequest, context) -> pb.CancelKvResponse:  # noqa: N802
        return await self._kv("CancelKv", request, context)

    async def DrcEvents(self, request: pb.DrcEventsRequest, context) -> pb.DrcEventsResponse:  # noqa: N802
        return await self._kv("DrcEvents", request, context)

    # --- control --------------------------------------------------------------------------

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        found = await self._engine.abort(request.request_id) if self._engine.ready else False
        return pb.AbortResponse(found=found)

    async def Health(  # noqa: N802
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        return pb.HealthResponse(
            ready=self.ready, worker_id=self._worker.id, role=self.role, model=self._model_name
        )

    async def Stats(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return stats_to_proto(
            self._worker.id, self.role, self._engine.stats(), self._role.kv_stats()
        )


class _Refused(Exception):
    """Admission refused with a specific gRPC status (not a pdd error: no HTTP meaning)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
