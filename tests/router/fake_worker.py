"""An in-process fake of the pdd Worker gRPC service (pdd/proto/worker.proto).

It emits a scripted, deterministic token sequence per Generate call and records what the
router did to it (requests, Aborts, cancelled streams, requests still running), so router
tests can assert cleanup exactly. Behaviour is set by plain attributes between requests.
Real-engine behaviour is tested end to end elsewhere; this only drives the router.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from pdd.proto import worker_pb2, worker_pb2_grpc

EOS = 2  # SmolLM2's <|im_end|>


@dataclass
class Script:
    """What the next Generate calls do."""

    tokens: list[int] = field(default_factory=lambda: [EOS])
    tokens_per_step: int = 1
    step_delay_s: float = 0.0
    first_delay_s: float = 0.0
    repeat: bool = False  # cycle the tokens forever (until max_tokens or cancellation)
    fail_code: grpc.StatusCode | None = None  # abort the RPC with this status at once
    error_after: int | None = None  # finish with "error" after this many tokens
    cached_tokens: int = 0


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str = "fake-0", max_model_len: int = 512):
        self.worker_id = worker_id
        self.max_model_len = max_model_len
        self.script = Script()
        self.ready = True
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.running: set[str] = set()
        self.aborts: list[str] = []
        self.cancelled: list[str] = []
        self.finished: dict[str, str] = {}

    def reset(self) -> None:
        self.script = Script()
        self.ready = True
        self.requests.clear()
        self.aborts.clear()
        self.cancelled.clear()
        self.finished.clear()

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        rid = request.request_id
        self.requests.append(request)
        self.running.add(rid)
        script = self.script
        try:
            if script.fail_code is not None:
                await context.abort(script.fail_code, "scripted failure")
            if script.first_delay_s:
                await asyncio.sleep(script.first_delay_s)
            async for resp in self._steps(request, script):
                yield resp
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.running.discard(rid)

    async def _steps(self, request, script: Script):
        s, rid = request.sampling, request.request_id
        emitted, i, first = 0, 0, True
        while True:
            if rid in self.aborts:
                self.finished[rid] = "abort"
                yield worker_pb2.GenerateResponse(finish_reason="abort", stop_token_id=-1)
                return
            step = self._take(script, i)
            i += len(step)
            step = step[: s.max_tokens - emitted]
            finish, stop_id = "", -1
            for j, tok in enumerate(step):
                if tok in s.stop_token_ids or (tok == EOS and not s.ignore_eos):
                    step, finish, stop_id = step[: j + 1], "stop", tok
                    break
            emitted += len(step)
            if not finish and emitted >= s.max_tokens:
                finish = "length"
            if not finish and script.error_after is not None and emitted >= script.error_after:
                finish = "error"
            if not finish and not step:
                finish = "stop"  # script ran out without an EOS
            yield self._response(request, step, finish, stop_id, first)
            first = False
            if finish:
                self.finished[rid] = finish
                return
            if script.step_delay_s:
                await asyncio.sleep(script.step_delay_s)

    @staticmethod
    def _take(script: Script, i: int) -> list[int]:
        n = script.tokens_per_step
        if script.repeat:
            toks = script.tokens
            return [toks[(i + k) % len(toks)] for k in range(n)]
        return list(script.tokens[i : i + n])

    def _response(self, request, step, finish, stop_id, first) -> worker_pb2.GenerateResponse:
        k = request.sampling.logprobs
        logprobs = []
        if k >= 0:
            for t in step:
                top = [
                    worker_pb2.TopLogprob(token_id=(t + r) % 49152, logprob=-0.5 - r)
                    for r in range(k)
                ]
                logprobs.append(worker_pb2.TokenLogprob(token_id=t, logprob=-0.5, top=top))
        return worker_pb2.GenerateResponse(
            token_ids=step,
            logprobs=logprobs,
            finish_reason=finish,
            num_prompt_tokens=len(request.prompt_token_ids) if first else 0,
            num_cached_tokens=self.script.cached_tokens if first else 0,
            stop_token_id=stop_id,
        )

    async def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request.request_id)
        return worker_pb2.AbortResponse(found=request.request_id in self.running)

    async def Health(self, request, context):  # noqa: N802
        return worker_pb2.HealthResponse(
            ready=self.ready, worker_id=self.worker_id, role="colocated", model="fake"
        )

    async def Stats(self, request, context):  # noqa: N802
        return worker_pb2.StatsResponse(
            worker_id=self.worker_id,
            role="colocated",
            running_requests=len(self.running),
            max_model_len=self.max_model_len,
        )


async def start_fake_worker(fake: FakeWorker) -> tuple[grpc.aio.Server, int]:
    """Serve ``fake`` on 127.0.0.1 with a free port. Caller stops the server."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port
