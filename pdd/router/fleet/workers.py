"""gRPC client for one worker (pdd/proto/worker.proto), and the proto <-> router adapters.

``WorkerClient`` owns one grpc.aio channel and the Abort calls it has in flight.
Lifecycle: created inside the router's event loop (``WorkerPool.start``), used by many
requests at once, ``close()`` once at shutdown (waits for pending Aborts, closes the channel).

Every control RPC (Health, Stats, Abort, PrepareKv, SendKv, CancelKv, DrcEvents) carries
``router.worker_rpc_timeout_s``; AwaitKv its own timeout plus that; Generate carries what is
left of the request's ``router.request_timeout_s``. gRPC errors become pdd errors here, at the
adapter (UNAVAILABLE: a draining or dead worker, 503; RESOURCE_EXHAUSTED: its queue is full,
429; UNAUTHENTICATED: the fleet's credentials disagree, 502). With ``security`` configured the
channel carries the worker token and TLS (``pdd.router.fleet.worker_auth``).
Fire-and-forget calls (Abort of an abandoned stream, CancelKv on a failure path) run as
background tasks the client owns and ``close()`` waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass

import grpc

from pdd.config import RouterConfig, WorkerConfig
from pdd.errors import (
    InvalidRequestError,
    OverloadedError,
    PddError,
    PromptRefMissing,
    UnavailableError,
    WorkerError,
)
from pdd.observability.context import request_context_interceptors
from pdd.proto import worker_pb2, worker_pb2_grpc
from pdd.proto.options import CHANNEL_OPTIONS
from pdd.router.fleet.worker_auth import WorkerCredentials
from pdd.router.types import (
    GenerationRequest,
    KvIn,
    PromptRef,
    SessionRef,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
)

log = logging.getLogger(__name__)


MIN_DEADLINE_S = 0.01  # a Generate started at the deadline still gets a (tiny) positive one
_KV_SOURCES = {"transfer": worker_pb2.KvIn.TRANSFER, "drc": worker_pb2.KvIn.DRC}


@dataclass(frozen=True, slots=True)
class Prepared:
    """A destination's PrepareKv answer. ``address`` goes back verbatim in SendKv."""

    cached_blocks: int
    reserved_blocks: int
    address: worker_pb2.PeerAddress
    landing_key: str = ""  # the reservation's secret, handed to P only (SendKv)
    keeps_prompt: bool = False  # later Generates may refer to the prompt (PromptRef)


@dataclass(frozen=True, slots=True)
class KvState:
    """AwaitKv's answer: state is done | failed | cancelled | timeout | unknown."""

    state: str
    bytes_received: int = 0
    blocks_ready: int = 0
    reason: str = ""


def grpc_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class WorkerClient:
    """Typed async calls to one worker. Safe to share between concurrent requests."""

    def __init__(
        self,
        worker: WorkerConfig,
        router: RouterConfig,
        credentials: WorkerCredentials | None = None,
    ):
        self.id = worker.id
        self.role = worker.role
        self.target = grpc_target(worker.host, worker.port)
        self._rpc_timeout = router.worker_rpc_timeout_s
        self._request_timeout = router.request_timeout_s
        self._channel = (credentials or WorkerCredentials()).channel(
            self.target,
            options=CHANNEL_OPTIONS,  # message limits, keepalive
            interceptors=request_context_interceptors(self.id),  # x-request-id, timeline
        )
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._background: set[asyncio.Task[object]] = set()

    async def health(self) -> worker_pb2.HealthResponse:
        try:
            return await self._stub.Health(worker_pb2.HealthRequest(), timeout=self._rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, self.id, "Health") from None

    async def stats(self) -> worker_pb2.StatsResponse:
        try:
            return await self._stub.Stats(worker_pb2.StatsRequest(), timeout=self._rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, self.id, "Stats") from None

    async def abort(self, request_id: str) -> bool:
        """Ask the worker to drop a request. Returns whether the worker still had it."""
        try:
            msg = worker_pb2.AbortRequest(request_id=request_id)
            resp = await self._stub.Abort(msg, timeout=self._rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, self.id, "Abort") from None
        return resp.found

    async def generate(
        self, req: GenerationRequest, *, kv_stage: bool = False, kv_in: KvIn | None = None,
        prompt_ref: PromptRef | None = None, session: SessionRef | None = None,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """Stream token events until the worker reports a finish reason.

        If the consumer stops early (stop string, client disconnect, cancellation), the gRPC
        stream is cancelled and an Abort is sent in the background, so the worker frees the
        request even if the cancellation is lost. Raises PddError subclasses on RPC failure;
        ``PromptRefMissing`` (nothing started) when the worker no longer holds the prompt
        ``prompt_ref`` refers to.
        """
        msg = request_to_proto(req, kv_stage=kv_stage, kv_in=kv_in, prompt_ref=prompt_ref)
        if session is not None:
            msg.session.CopyFrom(worker_pb2.Session(id=session.id, keep=session.keep))
        call = self._stub.Generate(msg, timeout=self._deadline_left(req))
        finished = False
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise WorkerError(f"worker {self.id} ended the stream without finishing")
                event = event_from_proto(msg, self.id)
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, self.id, "Generate") from None
        finally:
            if not finished:
                call.cancel()
                self._abort_in_background(req.request_id)

    def _deadline_left(self, req: GenerationRequest) -> float:
        """The gRPC deadline of a Generate: what is left of the request's end-to-end deadline
        (``arrival + router.request_timeout_s``), so the worker aborts the engine request by
        itself when the router's deadline passes, even if the router's cancel is lost."""
        if req.arrival <= 0:  # not stamped (direct use): the whole budget
            return self._request_timeout
        left = req.arrival + self._request_timeout - time.monotonic()
        return min(self._request_timeout, max(MIN_DEADLINE_S, left))

    async def prepare_kv(
        self,
        kv_request_id: str,
        prompt_token_ids: Sequence[int],
        lease_s: float,
        cache_salt: str = "",
    ) -> Prepared:
        """Reserve landing slots for the prompt blocks this worker lacks (in the prefix-cache
        namespace ``cache_salt``); get its address."""
        msg = worker_pb2.PrepareKvRequest(
            kv_request_id=kv_request_id, prompt_token_ids=list(prompt_token_ids),
            lease_s=lease_s, cache_salt=cache_salt,
        )  # fmt: skip
        resp = await self._call(self._stub.PrepareKv, msg, "PrepareKv")
        return Prepared(resp.cached_blocks, resp.reserved_blocks, resp.address, resp.landing_key,
                        resp.keeps_prompt)  # fmt: skip

    async def send_kv(
        self,
        kv_request_id: str,
        destinations: Sequence[worker_pb2.KvDestination],
        deadline_s: float,
    ) -> list[tuple[int, int]]:
        """Ask P to send its staged blocks; returns (raw, expected wire) bytes per destination
        (wire = raw from a P that reports no codec)."""
        msg = worker_pb2.SendKvRequest(
            kv_request_id=kv_request_id, destinations=list(destinations), deadline_s=deadline_s
        )
        resp = await self._call(self._stub.SendKv, msg, "SendKv")
        raw = list(resp.bytes_per_destination)
        wire = list(resp.wire_bytes_per_destination)
        if len(wire) != len(raw):
            wire = raw
        return list(zip(raw, wire, strict=True))

    async def await_kv(self, kv_request_id: str, timeout_s: float) -> KvState:
        """Wait up to ``timeout_s`` for this worker's inbound KV of a request."""
        msg = worker_pb2.AwaitKvRequest(kv_request_id=kv_request_id, timeout_s=timeout_s)
        resp = await self._call(
            self._stub.AwaitKv, msg, "AwaitKv", timeout=timeout_s + self._rpc_timeout
        )
        return KvState(resp.state, resp.bytes_received, resp.blocks_ready, resp.reason)

    async def cancel_kv(self, kv_request_id: str, reason: str, background: bool = False) -> bool:
        """CancelKv; ``background``: only the request's claim goes, the KV still lands (P and
        MD finish the transfer behind every other, ``worker.proto``)."""
        msg = worker_pb2.CancelKvRequest(
            kv_request_id=kv_request_id, reason=reason, background=background
        )
        return (await self._call(self._stub.CancelKv, msg, "CancelKv")).found

    async def warm_kv(self, peers: list[worker_pb2.PeerAddress]) -> int:
        """WarmKv (P): open and measure the links to these receivers; returns how many
        warm-ups started."""
        msg = worker_pb2.WarmKvRequest(peers=peers)
        return (await self._call(self._stub.WarmKv, msg, "WarmKv")).warming

    async def drc_events(self, since: int) -> worker_pb2.DrcEventsResponse:
        msg = worker_pb2.DrcEventsRequest(since=since)
        return await self._call(self._stub.DrcEvents, msg, "DrcEvents")

    async def _call(self, method, msg, name: str, timeout: float | None = None):  # type: ignore[no-untyped-def]
        try:
            return await method(msg, timeout=timeout or self._rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, self.id, name) from None

    def cancel_kv_in_background(
        self, kv_request_id: str, reason: str, after: Awaitable[object] | None = None,
        background: bool = False,
    ) -> None:  # fmt: skip
        """CancelKv without waiting, after ``after`` (the PrepareKv in flight) settles, so the
        cancel never overtakes the reservation it must release."""

        async def cancel() -> bool:
            if after is not None:
                await asyncio.gather(after, return_exceptions=True)
            return await self.cancel_kv(kv_request_id, reason, background)

        self._in_background(cancel(), "CancelKv")

    def end_session(self, session_id: str) -> None:
        """Ask the worker (in the background) to end the session it holds open between calls
        (``SessionRef``): the request will not continue there."""
        self._abort_in_background(session_id)

    def _abort_in_background(self, request_id: str) -> None:
        self._in_background(self.abort(request_id), "Abort")

    def _in_background(self, coro: Awaitable[object], what: str) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(lambda t: self._background_done(t, what))

    def _background_done(self, task: asyncio.Task[object], what: str) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.warning("%s on worker %s failed: %s", what, self.id, exc)

    async def close(self) -> None:
        """Wait (bounded) for pending background calls, then close the channel."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=self._rpc_timeout)
        for task in list(self._background):
            task.cancel()
        await self._channel.close()


def _param_of(exc: grpc.aio.AioRpcError) -> str | None:
    """The parameter a worker's 400 names (trailing metadata ``pdd-param``), if any."""
    for key, value in exc.trailing_metadata() or ():
        if key == "pdd-param":
            return value if isinstance(value, str) else value.decode()
    return None


def rpc_error(exc: grpc.aio.AioRpcError, worker_id: str, method: str) -> PddError:
    """Map a gRPC status to the pdd error the client should see."""
    code, details = exc.code(), exc.details() or ""
    text = f"worker {worker_id} {method}: {code.name}: {details}".rstrip(": ")
    if code is grpc.StatusCode.UNAVAILABLE:
        return UnavailableError(text)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OverloadedError(text)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return InvalidRequestError(details or text, param=_param_of(exc))
    if code is grpc.StatusCode.FAILED_PRECONDITION and details.startswith("prompt_ref:"):
        return PromptRefMissing(text)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return WorkerError(f"worker {worker_id} {method}: deadline exceeded", code="timeout")
    if code is grpc.StatusCode.UNAUTHENTICATED:  # a misconfigured fleet, not the client's fault
        return WorkerError(
            f"worker {worker_id} refused the router's credential ({details}); check that "
            "router and workers share security.worker_token_file and security.grpc_tls",
            code="worker_auth",
        )
    return WorkerError(text)


def request_to_proto(
    req: GenerationRequest, *, kv_stage: bool = False, kv_in: KvIn | None = None,
    prompt_ref: PromptRef | None = None,
) -> worker_pb2.GenerateRequest:  # fmt: skip
    """The Generate message; with ``prompt_ref`` its prompt holds only the tokens after the
    referred ones."""
    s = req.sampling
    sampling = worker_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        stop_token_ids=list(s.stop_token_ids),
        logprobs=-1 if s.logprobs is None else s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        prior_output_tokens=s.prior_output_tokens,
        logit_bias=dict(s.logit_bias),
        min_p=s.min_p,
        allowed_token_ids=list(s.allowed_token_ids),
        bad_words=[worker_pb2.TokenIds(ids=list(w)) for w in s.bad_words],
    )
    if s.seed is not None:
        sampling.seed = s.seed
    if s.prompt_logprobs is not None:
        sampling.prompt_logprobs = s.prompt_logprobs
    msg = worker_pb2.GenerateRequest(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids[prompt_ref.tokens if prompt_ref else 0 :]),
        sampling=sampling,
        kv_stage=kv_stage,
        cache_salt=req.cache_salt,
    )
    if req.constraint is not None:
        c = req.constraint
        msg.constraint.CopyFrom(
            worker_pb2.Constraint(kind=c.kind, spec=c.spec, resume=list(c.resume), param=c.param)
        )
    if prompt_ref is not None:
        msg.prompt_ref.CopyFrom(
            worker_pb2.PromptRef(kv_request_id=prompt_ref.kv_request_id, tokens=prompt_ref.tokens)
        )
    if kv_in is not None:
        msg.kv_in.CopyFrom(
            worker_pb2.KvIn(
                source=_KV_SOURCES[kv_in.source],
                kv_request_id=kv_in.kv_request_id,
                wait_s=kv_in.wait_s,
            )
        )
    return msg


def event_from_proto(msg: worker_pb2.GenerateResponse, worker_id: str) -> TokenEvent:
    token_ids = tuple(msg.token_ids)
    stop_id = msg.stop_token_id
    stopped_on_token = msg.finish_reason == "stop" and token_ids and token_ids[-1] == stop_id
    return TokenEvent(
        token_ids=token_ids,
        logprobs=tuple(_logprob(lp) for lp in msg.logprobs),
        prompt_logprobs=tuple(_logprob(lp) for lp in msg.prompt_logprobs),
        finish_reason=msg.finish_reason or None,
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        stop_token_id=stop_id if stopped_on_token and stop_id >= 0 else None,
        worker_id=worker_id,
        kv_staged_blocks=msg.kv_staged_blocks,
    )


def _logprob(lp: worker_pb2.TokenLogprob) -> TokenLogprob:
    top = tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top)
    return TokenLogprob(lp.token_id, lp.logprob, top, lp.rank)
