"""The worker service's admission over real gRPC with a scripted engine: the bounded queue
(RESOURCE_EXHAUSTED -> 429), drain (UNAVAILABLE for new work, accepted work goes on, Health
not ready) and the router's gRPC deadline aborting the engine request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from pdd.config import WorkerConfig
from pdd.engine.types import EngineDelta, EngineStats
from pdd.errors import OverloadedError, UnavailableError
from pdd.proto import worker_pb2 as pb
from pdd.proto import worker_pb2_grpc as pb_grpc
from pdd.router.fleet.workers import rpc_error
from pdd.worker.roles import (
    KV_IN,
    GenerateCall,
    KvAddress,
    KvDelta,
    KvStats,
    PrepareKvCall,
    PrepareKvResult,
)
from pdd.worker.service import WorkerService

pytestmark = pytest.mark.timeout(60)
MAX_NUM_SEQS = 1


class GatedEngine:
    """Each request emits one token, then waits for ``gate``, then finishes with "length"."""

    ready = True
    kv_geometry = None

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.running: set[str] = set()
        self.closed: list[str] = []  # requests whose stream was closed before finishing

    def validate(self, prompt, sampling) -> None:
        return None

    def stats(self) -> EngineStats:
        n = len(self.running)
        waiting = max(0, n - MAX_NUM_SEQS)
        return EngineStats(n - waiting, waiting, 0.0, 0, 0, 0, 512, 32, MAX_NUM_SEQS)

    async def generate(self, rid: str) -> AsyncIterator[EngineDelta]:
        self.running.add(rid)
        finished = False
        try:
            yield EngineDelta((7,), None, None, None, 3, 0)
            await self.gate.wait()
            finished = True
            yield EngineDelta((8,), None, "length", None, 3, 0)
        finally:
            self.running.discard(rid)
            if not finished:
                self.closed.append(rid)


class KvRole:
    """A role that serves PrepareKv and Generate(kv_in) on the gated engine."""

    supports = frozenset({"PrepareKv", KV_IN})

    def __init__(self, engine: GatedEngine) -> None:
        self._engine = engine

    async def generate(self, call: GenerateCall) -> AsyncIterator[KvDelta]:
        async for delta in self._engine.generate(call.request_id):
            yield KvDelta(delta)

    async def prepare_kv(self, call: PrepareKvCall) -> PrepareKvResult:
        return PrepareKvResult(cached_blocks=0, reserved_blocks=1, address=KvAddress())

    def kv_stats(self) -> KvStats:
        return KvStats()


class NoMetrics:
    def request_done(self, role: str, outcome: str) -> None:
        return None

    def prompt_received(self, role: str, rpc: str, tokens: int) -> None:
        return None

    def prompt_ref(self, role: str, resolved: bool) -> None:
        return None


def generate_req(rid: str, kv_id: str = "") -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=2)
    )
    if kv_id:
        req.kv_in.CopyFrom(pb.KvIn(source=pb.KvIn.DRC, kv_request_id=kv_id, wait_s=1))
    return req


async def first_reply(stub, rid: str, kv_id: str = "", timeout: float = 10):
    """Open a Generate, wait for its first reply; returns the call (still streaming)."""
    call = stub.Generate(generate_req(rid, kv_id), timeout=timeout)
    await call.read()
    return call


async def rest(call) -> list[str]:
    """The finish reasons of the remaining replies of a call opened by ``first_reply``."""
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r.finish_reason)
    return out


async def refusal(stub, rid: str, kv_id: str = "") -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(generate_req(rid, kv_id), timeout=5):
            pass
    return err.value


def run(scenario, max_queued: int = 1, drain_timeout_s: float = 5.0):
    """Serve a WorkerService on the gated engine; run ``scenario(stub, service, engine)``."""

    async def go():
        engine = GatedEngine()
        worker = WorkerConfig(
            id="w0", role="main_decode", max_queued_requests=max_queued,
            drain_timeout_s=drain_timeout_s,
        )  # fmt: skip
        service = WorkerService(engine, worker, "m", NoMetrics(), KvRole(engine))
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await scenario(pb_grpc.WorkerStub(ch), service, engine)
        finally:
            engine.gate.set()
            await server.stop(None)

    return asyncio.run(go())


def test_a_full_queue_refuses_with_resource_exhausted_which_the_router_answers_429():
    async def scenario(stub, service, engine):
        running = await first_reply(stub, "a")  # runs (max_num_seqs 1)
        queued = await first_reply(stub, "b")  # waits: the queue holds max_queued_requests=1
        err = await refusal(stub, "c")
        engine.gate.set()
        tails = [await rest(c) for c in (running, queued)]
        return err, tails, service.active

    err, tails, active = run(scenario)
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == (
        "worker w0 is full: 1 requests queued beyond its 1 running (max_queued_requests 1); "
        "retry later"
    )
    mapped = rpc_error(err, "w0", "Generate")
    assert isinstance(mapped, OverloadedError)
    assert (mapped.status_code, mapped.retry_after_s) == (429, 1.0)
    assert tails == [["length"], ["length"]]
    assert active == 0


def test_drain_refuses_new_work_and_finishes_what_it_accepted():
    async def scenario(stub, service, engine):
        await stub.PrepareKv(pb.PrepareKvRequest(kv_request_id="k1", prompt_token_ids=[1]))
        in_flight = await first_reply(stub, "a")
        service.start_drain()
        health = await stub.Health(pb.HealthRequest(), timeout=5)
        new_gen = await refusal(stub, "b")
        with pytest.raises(grpc.aio.AioRpcError) as new_kv:
            await stub.PrepareKv(pb.PrepareKvRequest(kv_request_id="k2", prompt_token_ids=[1]))
        unknown_kv = await refusal(stub, "c", kv_id="k9")
        accepted = await first_reply(stub, "d", kv_id="k1")  # MD finishing a request it took
        engine.gate.set()
        tails = [await rest(c) for c in (in_flight, accepted)]
        return health, new_gen, new_kv.value, unknown_kv, tails, service.active

    health, new_gen, new_kv, unknown_kv, tails, active = run(scenario, max_queued=4)
    assert health.ready is False
    for err in (new_gen, new_kv, unknown_kv):
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert err.details() == (
            "worker w0 is draining (shutting down) and accepts no new requests; retry on "
            "another worker"
        )
    assert isinstance(rpc_error(new_gen, "w0", "Generate"), UnavailableError)  # 503 + Retry-After
    assert tails == [["length"], ["length"]]
    assert active == 0


def test_the_routers_deadline_aborts_the_engine_request_on_the_worker():
    async def scenario(stub, service, engine):
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:  # 2 s: it starts even on a busy host
            async for resp in stub.Generate(generate_req("slow"), timeout=2.0):
                got.extend(resp.token_ids)
        for _ in range(100):  # the server side notices the deadline on its own
            if not engine.running:
                break
            await asyncio.sleep(0.02)
        return got, err.value, engine.closed, engine.running, service.active

    got, err, closed, running, active = run(scenario)
    assert got == [7]  # the engine ran it: the deadline ended it while it waited
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert (closed, running, active) == (["slow"], set(), 0)
