"""gRPC client for one worker (pdd/proto/worker.proto), and the proto <-> router adapters.

``WorkerClient`` owns one grpc.aio channel and the Abort calls it has in flight.
Lifecycle: created inside the router's event loop (``WorkerPool.start``), used by many
requests at once, ``close()`` once at shutdown (waits for pending Aborts, closes the channel).

Every control RPC (Health, Stats, Abort) carries ``router.worker_rpc_timeout_s``; Generate
carries ``router.request_timeout_s``. gRPC errors become pdd errors here, at the adapter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from pdd.config import RouterConfig, WorkerConfig
from pdd.errors import (
    InvalidRequestError,
    OverloadedError,
    PddError,
    UnavailableError,
    WorkerError,
)
from pdd.proto import worker_pb2, worker_pb2_grpc
from pdd.router.types import GenerationRequest, TokenEvent, TokenLogprob, TopLogprob

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


def grpc_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class WorkerClient:
    """Typed async calls to one worker. Safe to share between concurrent requests."""

    def __init__(self, worker: WorkerConfig, router: RouterConfig):
        self.id = worker.id
        self.role = worker.role
        self.target = grpc_target(worker.host, worker.port)
        self._rpc_timeout = router.worker_rpc_timeout_s
        self._request_timeout = router.request_timeout_s
        self._channel = grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._aborts: set[asyncio.Task[bool]] = set()

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

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream token events until the worker reports a finish reason.

        If the consumer stops early (stop string, client disconnect, cancellation), the gRPC
        stream is cancelled and an Abort is sent in the background, so the worker frees the
        request even if the cancellation is lost. Raises PddError subclasses on RPC failure.
        """
        call = self._stub.Generate(request_to_proto(req), timeout=self._request_timeout)
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

    def _abort_in_background(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._abort_done)

    def _abort_done(self, task: asyncio.Task[bool]) -> None:
        self._aborts.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.warning("abort on worker %s failed: %s", self.id, exc)

    async def close(self) -> None:
        """Wait (bounded) for pending Aborts, then close the channel."""
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=self._rpc_timeout)
        for task in list(self._aborts):
            task.cancel()
        await self._channel.close()


def rpc_error(exc: grpc.aio.AioRpcError, worker_id: str, method: str) -> PddError:
    """Map a gRPC status to the pdd error the client should see."""
    code, details = exc.code(), exc.details() or ""
    text = f"worker {worker_id} {method}: {code.name}: {details}".rstrip(": ")
    if code is grpc.StatusCode.UNAVAILABLE:
        return UnavailableError(text)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OverloadedError(text)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return InvalidRequestError(details or text)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return WorkerError(f"worker {worker_id} {method}: deadline exceeded", code="timeout")
    return WorkerError(text)


def request_to_proto(req: GenerationRequest) -> worker_pb2.GenerateRequest:
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
    )
    if s.seed is not None:
        sampling.seed = s.seed
    return worker_pb2.GenerateRequest(
        request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), sampling=sampling
    )


def event_from_proto(msg: worker_pb2.GenerateResponse, worker_id: str) -> TokenEvent:
    token_ids = tuple(msg.token_ids)
    stop_id = msg.stop_token_id
    stopped_on_token = msg.finish_reason == "stop" and token_ids and token_ids[-1] == stop_id
    return TokenEvent(
        token_ids=token_ids,
        logprobs=tuple(
            TokenLogprob(
                lp.token_id, lp.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top)
            )
            for lp in msg.logprobs
        ),
        finish_reason=msg.finish_reason or None,
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        stop_token_id=stop_id if stopped_on_token and stop_id >= 0 else None,
        worker_id=worker_id,
    )
