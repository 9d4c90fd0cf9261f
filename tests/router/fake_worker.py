"""An in-process fake of the pdd Worker gRPC service (pdd/proto/worker.proto).

It emits a scripted, deterministic token sequence per Generate call and records what the
router did to it (requests, Aborts, cancelled streams, requests still running), so router
tests can assert cleanup exactly. Behaviour is set by plain attributes between requests.
Real-engine behaviour is tested end to end elsewhere; this only drives the router.

Roles: one fake plays colocated, prefill, relay_decode or main_decode. The scripted tokens
are "the model's output" for any prompt: a Generate that continues a request (``kv_in``
set) starts at the position ``len(prompt) - len(original prompt)`` and first checks that
its prompt is exactly the original prompt plus the scripted tokens before that position
(else it records a violation and fails the request). The KV RPCs are ``fake_kv``'s.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from pdd.kv_geometry import KvGeometry
from pdd.proto import worker_pb2, worker_pb2_grpc
from pdd.proto.options import SERVER_OPTIONS
from pdd.worker.prompt_book import PromptBook
from tests.router.fake_kv import BLOCK_BYTES, BLOCK_SIZE, FakeKvNode, FakeKvPlane

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

    def token(self, i: int) -> int | None:
        """The model's i-th output token (None past the end of a non-repeating script)."""
        if self.repeat:
            return self.tokens[i % len(self.tokens)]
        return self.tokens[i] if i < len(self.tokens) else None


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        worker_id: str = "fake-0",
        max_model_len: int = 512,
        role: str = "colocated",
        plane: FakeKvPlane | None = None,
    ):
        self.worker_id = worker_id
        self.max_model_len = max_model_len
        self.role = role
        self.kv = FakeKvNode(plane, worker_id, role) if plane is not None else None
        self.max_num_seqs = 8
        self.geometry: KvGeometry | None = None  # reported in Health when set (pdd.kv_geometry)
        self.stats_running = 0  # extra running requests reported in Stats (load scripting)
        self.wan_bandwidth_bps = 0.0
        self.kv_arena_blocks = 0  # Stats: no arena reported (the router assumes room)
        self.kv_free_blocks = 0
        self.prefill_tokens_per_s = 0.0  # MD: its measured prefill rate (0: none measured)
        self.script = Script()
        self.ready = True
        self.instance_id = "first-process"  # change it to play a restarted worker
        self.health_delay_s = 0.0  # Health answers this late (a worker on a saturated host)
        self.slow_health_calls = 0
        self.prepare_delay_s = 0.0  # PrepareKv reserves, then answers this late (cut off)
        self.await_delay_s = 0.0  # AwaitKv answers this late (cut off after PrepareKv)
        self.prepare_fail_code: grpc.StatusCode | None = None  # PrepareKv refused (e.g. full)
        # PrepareKv's prompt kept for later Generates' prompt_ref, as a real RLD/MD does;
        # forget_prompts plays a worker that lost them (restarted): such a Generate is refused
        self.keeps_prompt = True
        self.forget_prompts = False
        self.kept_prompts = PromptBook()  # the real worker's book
        self.sent_prompt_tokens: list[int] = []  # per Generate: prompt tokens that crossed
        self.refused_refs = 0
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.running: set[str] = set()
        self.aborts: list[str] = []
        self.warm_calls: list[list[str]] = []  # P: the receivers each WarmKv named
        self.cancelled: list[str] = []
        self.finished: dict[str, str] = {}
        self.violations: list[str] = []

    def reset(self) -> None:
        self.script = Script()
        self.ready = True
        self.health_delay_s = 0.0
        self.slow_health_calls = 0
        self.prepare_delay_s = 0.0
        self.await_delay_s = 0.0
        self.prepare_fail_code = None
        self.keeps_prompt, self.forget_prompts = True, False
        self.kept_prompts = PromptBook()
        self.sent_prompt_tokens.clear()
        self.refused_refs = 0
        self.stats_running = 0
        self.requests.clear()
        self.aborts.clear()
        self.cancelled.clear()
        self.finished.clear()
        self.violations.clear()

    def stream_stopped(self, rid: str) -> bool:
        """Whether the router stopped ``rid``'s Generate stream: it cancels the stream and
        sends Abort, and whichever reaches the worker first ends it (a loaded host may order
        them either way; an Abort that wins ends the stream with finish_reason "abort")."""
        return rid in self.cancelled or self.finished.get(rid) == "abort"

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        rid = request.request_id
        self.sent_prompt_tokens.append(len(request.prompt_token_ids))
        if request.HasField("prompt_ref"):
            request = await self._resolve_prompt(request, context)
        self.requests.append(request)
        self.running.add(rid)
        script = self.script
        kv_id = request.kv_in.kv_request_id if request.HasField("kv_in") else ""
        try:
            if script.fail_code is not None:
                await context.abort(script.fail_code, "scripted failure")
            if script.first_delay_s:
                await asyncio.sleep(script.first_delay_s)
            start = self._continuation_start(request, script)
            if start is None:
                yield worker_pb2.GenerateResponse(finish_reason="error", stop_token_id=-1)
                return
            if kv_id and self.kv is not None:
                await self.kv.load(kv_id, request.kv_in.wait_s)
            async for resp in self._steps(request, script, start):
                yield resp
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.running.discard(rid)
            if kv_id and self.kv is not None:
                self.kv.release(kv_id, "done")  # the request's load ended either way

    async def _resolve_prompt(self, request, context):
        """The request with its whole prompt (the kept one's head + what was sent)."""
        ref = request.prompt_ref
        whole_prompt = (None if self.forget_prompts else
                        self.kept_prompts.resolve(ref.kv_request_id, ref.tokens,
                                                  request.prompt_token_ids))  # fmt: skip
        if whole_prompt is None:
            self.refused_refs += 1
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"prompt_ref: worker {self.worker_id} does not hold it")  # fmt: skip
        whole = worker_pb2.GenerateRequest()
        whole.CopyFrom(request)
        del whole.prompt_token_ids[:]
        whole.prompt_token_ids.extend(whole_prompt)
        return whole

    def _continuation_start(self, request, script: Script) -> int | None:
        """Output position this Generate continues from; None if its prompt is wrong."""
        if request.HasField("kv_in") and request.sampling.HasField("prompt_logprobs"):
            # a real worker refuses it: it would load the prompt's KV, not compute it
            self.violations.append(f"{request.request_id}: prompt_logprobs with kv_in")
        if not request.HasField("kv_in") or self.kv is None:
            return 0
        original = self.kv.plane.prompts.get(request.kv_in.kv_request_id)
        prompt = tuple(request.prompt_token_ids)
        if original is None and request.kv_in.source == worker_pb2.KvIn.DRC:
            # MD's DRC matches by content, so no PrepareKv need have named the id (MD's
            # recompute warm-up can even arrive before P staged it): the prompt itself
            original = self.kv.plane.prompts.setdefault(request.kv_in.kv_request_id, prompt)
        if original is None:
            self.violations.append(f"{request.request_id}: unknown kv_request_id")
            return None
        tail = prompt[len(original) :]
        expected = tuple(script.token(i) for i in range(len(tail)))
        if prompt[: len(original)] != original or tail != expected:
            self.violations.append(f"{request.request_id}: continues {tail}, want {expected}")
            return None
        return len(tail)

    async def _steps(self, request, script: Script, start: int):
        s, rid = request.sampling, request.request_id
        emitted, i, first = 0, start, True
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
        step = [script.token(i + k) for k in range(script.tokens_per_step)]
        return [t for t in step if t is not None]

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
        prompt_logprobs = []
        if first and request.sampling.HasField("prompt_logprobs"):  # -1.0 each, rank 2
            k = request.sampling.prompt_logprobs
            for t in request.prompt_token_ids[1:]:
                top = [worker_pb2.TopLogprob(token_id=(t + r + 1) % 49152, logprob=-0.5 - r)
                       for r in range(k)]  # fmt: skip
                prompt_logprobs.append(
                    worker_pb2.TokenLogprob(token_id=t, logprob=-1.0, top=top, rank=2)
                )
        staged = 0
        if finish and request.kv_stage and self.kv is not None:
            staged = self.kv.stage(request.request_id, list(request.prompt_token_ids))
        return worker_pb2.GenerateResponse(
            token_ids=step,
            logprobs=logprobs,
            finish_reason=finish,
            num_prompt_tokens=len(request.prompt_token_ids) if first else 0,
            num_cached_tokens=self.script.cached_tokens if first else 0,
            stop_token_id=stop_id,
            kv_staged_blocks=staged,
            prompt_logprobs=prompt_logprobs,
        )

    async def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request.request_id)
        return worker_pb2.AbortResponse(found=request.request_id in self.running)

    async def Health(self, request, context):  # noqa: N802
        if self.health_delay_s > 0:
            self.slow_health_calls += 1
            await asyncio.sleep(self.health_delay_s)
        health = worker_pb2.HealthResponse(
            ready=self.ready, worker_id=self.worker_id, role=self.role, model="fake",
            instance_id=self.instance_id,
        )  # fmt: skip
        if self.geometry is not None:
            health.geometry.CopyFrom(self.geometry.to_proto())
        return health

    async def Stats(self, request, context):  # noqa: N802
        return worker_pb2.StatsResponse(
            worker_id=self.worker_id,
            role=self.role,
            running_requests=len(self.running) + self.stats_running,
            max_model_len=self.max_model_len,
            block_size=BLOCK_SIZE if self.kv else 0,
            kv_block_bytes=BLOCK_BYTES if self.kv else 0,
            max_num_seqs=self.max_num_seqs,
            wan_bandwidth_bps=self.wan_bandwidth_bps,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            pinned_slots=len(self.kv.held()) if self.kv else 0,
            kv_arena_blocks=self.kv_arena_blocks,
            kv_free_blocks=self.kv_free_blocks,
            kv_address=self.kv.address() if self.kv else None,
        )

    # --- KV plane ---------------------------------------------------------------------------

    def _node(self) -> FakeKvNode:
        assert self.kv is not None, f"{self.worker_id} has no KV plane"
        return self.kv

    async def PrepareKv(self, request, context):  # noqa: N802
        if self.prepare_fail_code is not None:  # refused before reserving anything
            await context.abort(self.prepare_fail_code, "no room for the KV (scripted)")
        response = self._node().prepare(request.kv_request_id, list(request.prompt_token_ids))
        if self.keeps_prompt:
            response.keeps_prompt = self.kept_prompts.put(
                request.kv_request_id, request.prompt_token_ids
            )
        if self.prepare_delay_s:
            await asyncio.sleep(self.prepare_delay_s)
        return response

    async def SendKv(self, request, context):  # noqa: N802
        kv_id = request.kv_request_id
        for _ in range(200):  # streamed (router.pdd.stream_kv): sent while P still prefills
            if kv_id in self._node().staged or kv_id not in self.running:
                break
            await asyncio.sleep(0.01)
        sent = self._node().send(kv_id, list(request.destinations))
        if sent is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nothing staged")
        return worker_pb2.SendKvResponse(
            staged_blocks=self._node().staged.get(request.kv_request_id, 0),
            bytes_per_destination=sent,
        )

    async def AwaitKv(self, request, context):  # noqa: N802
        if self.await_delay_s:
            await asyncio.sleep(self.await_delay_s)
        return await self._node().await_kv(request.kv_request_id, request.timeout_s)

    async def CancelKv(self, request, context):  # noqa: N802
        found = self._node().cancel(request.kv_request_id, request.reason, request.background)
        return worker_pb2.CancelKvResponse(found=found)

    async def DrcEvents(self, request, context):  # noqa: N802
        return self._node().drc_events(request.since)

    async def WarmKv(self, request, context):  # noqa: N802
        self.warm_calls.append([a.name for a in request.peers])
        return worker_pb2.WarmKvResponse(warming=len(request.peers))


async def start_fake_worker(fake: FakeWorker) -> tuple[grpc.aio.Server, int]:
    """Serve ``fake`` on 127.0.0.1 with a free port. Caller stops the server."""
    server = grpc.aio.server(options=SERVER_OPTIONS)  # as a real worker
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port
