"""The router-facing gRPC servicer of one worker (pdd.worker.v1.Worker over grpc.aio).

Owns: request admission (validation, draining, the bounded queue, what the role supports),
mapping pdd errors to gRPC status codes, and the link between a Generate stream and its engine
request: when the stream ends for any reason (finished, client cancelled, the router's gRPC
deadline, server stopping) the role's generator is closed, which aborts the engine request if
it was still running and releases whatever KV the role held for it.

Bounded queue: Generate streams beyond the engine's ``max_num_seqs`` wait in its queue; once
``workers[].max_queued_requests`` wait, one more is RESOURCE_EXHAUSTED (429 at the router).

Drain (``start_drain``, on SIGTERM): new Generate and PrepareKv calls get UNAVAILABLE, Health
reports not ready (so the router stops picking this worker), and work already accepted goes
on: SendKv, AwaitKv, CancelKv, DrcEvents, and a Generate that consumes KV this worker
reserved with PrepareKv before the drain (an MD finishing a request it took). ``active``
falls to zero as the requests in flight finish.

KV RPCs (SendKv, PrepareKv, AwaitKv, CancelKv, DrcEvents) go to the role policy when it
supports them, else UNIMPLEMENTED: each through its typed capability (pdd.worker.roles), its
request and response converted in pdd.worker.convert; a Generate asking for ``kv_stage`` /
``kv_in`` a role cannot honour is FAILED_PRECONDITION.

Prompt references: a successful PrepareKv keeps its prompt (``PromptBook``, a bounded cache)
and answers ``keeps_prompt``; a later Generate of the request may send only the tokens after
it (``prompt_ref``). One this worker no longer holds is FAILED_PRECONDITION ("prompt_ref: ...")
before anything starts; the router then sends the prompt whole.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

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
from pdd.worker import convert
from pdd.worker.convert import (
    call_from_proto,
    kv_delta_to_proto,
    sampling_from_proto,
    stats_to_proto,
)
from pdd.worker.faults import WorkerFaults
from pdd.worker.metrics import WorkerMetrics
from pdd.worker.prompt_book import PromptBook
from pdd.worker.roles import (
    KV_IN,
    KV_STAGE,
    SESSIONS,
    CancelsKv,
    GenerateCall,
    KeepsSessions,
    PublishesDrc,
    ReceivesKv,
    RolePolicy,
    SendsKv,
    WarmsLinks,
)

if TYPE_CHECKING:
    from pdd.engine.engine import Engine

log = logging.getLogger(__name__)


PARAM_METADATA = "pdd-param"  # trailing metadata: the request parameter a 400 names


def error_metadata(err: PddError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata of an error status: the parameter it names, if any."""
    param = getattr(err, "param", None)
    return ((PARAM_METADATA, param),) if param else ()


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
        self._instance_id = uuid.uuid4().hex  # one per process: a restart shows as a new id
        self._metrics = metrics
        self._role = role
        self.draining = False
        self._faults = WorkerFaults.of(worker)  # tests only: None unless worker.faults is set
        self.active = 0  # Generate streams admitted and not yet ended
        # KV requests this worker accepted (PrepareKv): their Generate is finishing accepted
        # work, so a draining worker still admits it. Bounded: old ids fall out.
        self._accepted_kv: OrderedDict[str, None] = OrderedDict()
        # their prompts, so that later calls of the same request refer to them (prompt_ref)
        self._prompts = PromptBook()
        # Why the engine cannot be trusted with work right now (None: it can); set by the
        # composition root, e.g. the KV plane's overdue fences.
        self.stall_reason: Callable[[], str | None] = lambda: None

    def start_drain(self) -> None:
        """Refuse new work from now on; what is in flight goes on (see the module doc)."""
        self.draining = True

    @property
    def role(self) -> str:
        return self._worker.role.value

    @property
    def ready(self) -> bool:
        return self._engine.ready and not self.draining and self.stall_reason() is None

    # --- Generate -------------------------------------------------------------------------

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id
        try:
            call = self._admit(request)
        except PddError as err:
            self._metrics.request_done(self.role, "rejected")
            await context.abort(status_for(err), err.message, error_metadata(err))
            return  # not reached: abort raises
        except _Refused as ref:
            self._metrics.request_done(self.role, "rejected")
            await context.abort(ref.code, ref.message)
            return
        outcome = "error"
        self.active += 1
        try:
            async with contextlib.aclosing(self._role.generate(call)) as stream:
                first = True
                kill = self._faults.stream_kill(rid) if self._faults is not None else None
                async for out in stream:
                    if kill is not None:  # fault injection (tests): may exit the process
                        kill.before_send(len(out.delta.token_ids))
                    yield kv_delta_to_proto(out, first)
                    first = False
                    if out.delta.finish_reason is not None:
                        outcome = out.delta.finish_reason
        except PddError as err:
            outcome = (
                "rejected" if isinstance(err, InvalidRequestError | OverloadedError) else "error"
            )
            log.warning("request %s failed: %s", rid, err.message)
            await context.abort(status_for(err), err.message, error_metadata(err))
        except BaseException:  # cancelled by the client or by server shutdown
            outcome = "cancelled"
            raise
        finally:
            self.active -= 1
            self._metrics.request_done(self.role, outcome)

    def _admit(self, request: pb.GenerateRequest) -> GenerateCall:
        """Validate the request. Raises PddError or _Refused (nothing started then)."""
        kv_id = request.kv_in.kv_request_id if request.HasField("kv_in") else ""
        if not (self.draining and kv_id and kv_id in self._accepted_kv):
            self._require_ready()
        if not request.request_id:
            raise InvalidRequestError("request_id must not be empty", param="request_id")
        if not request.HasField("sampling"):
            raise InvalidRequestError("sampling must be set", param="sampling")
        constraint = request.constraint if request.HasField("constraint") else None
        spec = sampling_from_proto(request.sampling, constraint)
        call = call_from_proto(request, spec)
        self._metrics.prompt_received(self.role, "Generate", len(request.prompt_token_ids))
        if request.HasField("prompt_ref"):
            call = replace(call, prompt=self._referred_prompt(request))
        for wanted, feature in ((call.kv_stage, KV_STAGE), (call.kv_in is not None, KV_IN)):
            if wanted and feature not in self._role.supports:
                raise _Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"worker {self._worker.id} (role {self.role}) cannot serve {feature}",
                )
        if spec.prompt_logprobs is not None and (call.kv_in is not None or call.session):
            raise InvalidRequestError(
                "prompt_logprobs needs the whole prompt computed here: not with kv_in or a "
                "session", param="prompt_logprobs",
            )  # fmt: skip
        self._engine.validate(call.prompt, spec)
        self._check_queue()
        return call

    def _referred_prompt(self, request: pb.GenerateRequest) -> list[int]:
        """The whole prompt of a Generate that refers to its PrepareKv's prompt."""
        ref = request.prompt_ref
        prompt = self._prompts.resolve(ref.kv_request_id, ref.tokens, request.prompt_token_ids)
        self._metrics.prompt_ref(self.role, prompt is not None)
        if prompt is None:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"prompt_ref: worker {self._worker.id} does not hold {ref.tokens} prompt "
                f"tokens of {ref.kv_request_id!r}; send the prompt whole",
            )
        return prompt

    def _check_queue(self) -> None:
        """OverloadedError when admitting one more would queue more than the bound."""
        limit = self._worker.max_queued_requests
        stats = self._engine.stats()
        queued = max(stats.waiting, self.active - stats.max_num_seqs)
        if queued >= limit:
            raise OverloadedError(
                f"worker {self._worker.id} is full: {queued} requests queued beyond its "
                f"{stats.max_num_seqs} running (max_queued_requests {limit}); retry later"
            )

    def _require_ready(self) -> None:
        if self.draining:
            raise UnavailableError(
                f"worker {self._worker.id} is draining (shutting down) and accepts no new "
                "requests; retry on another worker"
            )
        if not self._engine.ready:
            raise UnavailableError("engine is not ready")

    # --- KV plane -------------------------------------------------------------------------

    async def _kv(
        self,
        name: str,
        request: Any,
        context: grpc.aio.ServicerContext,
        handle: Callable[[], Awaitable[Any]],
        respond: Callable[[Any], Any],
    ) -> Any:
        """Serve KV RPC ``name`` with ``handle`` (the role's typed method over the call
        converted from ``request``) if the role supports it; its result goes out through
        ``respond`` (pdd.worker.convert); PddError -> its gRPC status."""
        if name not in self._role.supports:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"worker {self._worker.id} (role {self.role}) does not serve {name}",
            )
        try:
            new_work = name == _NEW_WORK
            if new_work or not self._engine.ready:
                self._require_ready()  # a draining worker still settles what it accepted
            response = respond(await handle())
            if new_work:
                self._remember_kv(request.kv_request_id)
            return response
        except PddError as err:
            log.info("%s failed: %s", name, err.message)
            await context.abort(status_for(err), err.message)

    def _remember_kv(self, kv_request_id: str) -> None:
        self._accepted_kv[kv_request_id] = None
        if len(self._accepted_kv) > _ACCEPTED_KV_KEPT:
            self._accepted_kv.popitem(last=False)

    async def SendKv(self, request: pb.SendKvRequest, context) -> pb.SendKvResponse:  # noqa: N802
        role, call = cast(SendsKv, self._role), convert.send_kv_call(request)
        handle = lambda: role.send_kv(call)  # noqa: E731
        return await self._kv("SendKv", request, context, handle, convert.send_kv_response)

    async def PrepareKv(self, request: pb.PrepareKvRequest, context) -> pb.PrepareKvResponse:  # noqa: N802
        role, call = cast(ReceivesKv, self._role), convert.prepare_kv_call(request)
        handle = lambda: role.prepare_kv(call)  # noqa: E731
        self._metrics.prompt_received(self.role, "PrepareKv", len(call.prompt))
        response = await self._kv("PrepareKv", request, context, handle,
                                  convert.prepare_kv_response)  # fmt: skip
        # reached only if it succeeded: later calls of this request may refer to its prompt
        response.keeps_prompt = self._prompts.put(call.kv_request_id, call.prompt)
        return response

    async def AwaitKv(self, request: pb.AwaitKvRequest, context) -> pb.AwaitKvResponse:  # noqa: N802
        role, call = cast(ReceivesKv, self._role), convert.await_kv_call(request)
        handle = lambda: role.await_kv(call)  # noqa: E731
        return await self._kv("AwaitKv", request, context, handle, convert.await_kv_response)

    async def CancelKv(self, request: pb.CancelKvRequest, context) -> pb.CancelKvResponse:  # noqa: N802
        role, call = cast(CancelsKv, self._role), convert.cancel_kv_call(request)
        handle = lambda: role.cancel_kv(call)  # noqa: E731
        return await self._kv("CancelKv", request, context, handle, convert.cancel_kv_response)

    async def DrcEvents(self, request: pb.DrcEventsRequest, context) -> pb.DrcEventsResponse:  # noqa: N802
        role, call = cast(PublishesDrc, self._role), convert.drc_events_call(request)
        handle = lambda: role.drc_events(call)  # noqa: E731
        return await self._kv("DrcEvents", request, context, handle, convert.drc_events_response)

    async def WarmKv(self, request: pb.WarmKvRequest, context) -> pb.WarmKvResponse:  # noqa: N802
        role, call = cast(WarmsLinks, self._role), convert.warm_kv_call(request)
        handle = lambda: role.warm_kv(call)  # noqa: E731
        return await self._kv("WarmKv", request, context, handle, convert.warm_kv_response)

    # --- control --------------------------------------------------------------------------

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        found = await self._engine.abort(request.request_id) if self._engine.ready else False
        if SESSIONS in self._role.supports:  # a session of that id, open between calls
            found = cast(KeepsSessions, self._role).end_session(request.request_id) or found
        return pb.AbortResponse(found=found)

    async def Health(  # noqa: N802
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        response = pb.HealthResponse(
            ready=self.ready, worker_id=self._worker.id, role=self.role, model=self._model_name,
            instance_id=self._instance_id,
        )  # fmt: skip
        geometry = self._engine.kv_geometry
        if geometry is not None:
            response.geometry.CopyFrom(geometry.to_proto())
        return response

    async def Stats(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return stats_to_proto(
            self._worker.id, self.role, self._engine.stats(), self._role.kv_stats()
        )


_NEW_WORK = "PrepareKv"  # the KV call that starts work (refused while draining)
_ACCEPTED_KV_KEPT = 4096


class _Refused(Exception):
    """Admission refused with a specific gRPC status (not a pdd error: no HTTP meaning)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
