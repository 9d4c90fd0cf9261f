"""The worker shell's KV mechanism without an engine: slot pool, fences, inbound state, the
service's refusals for what a role does not serve, and the /health probe."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client import REGISTRY

from pdd.cache.arena import FenceBoard
from pdd.config import PddConfig, WorkerConfig
from pdd.engine.connector_params import FenceRef
from pdd.errors import OverloadedError
from pdd.proto import worker_pb2 as pb
from pdd.proto import worker_pb2_grpc as pb_grpc
from pdd.transfer import InboundResult, TransferState
from pdd.worker.inbound import InboundState, parts_of, split_wire_id, wire_id
from pdd.worker.metrics import WorkerMetrics
from pdd.worker.roles import KvStats, PlainRole, RoleContext
from pdd.worker.service import WorkerService
from pdd.worker.slots import Fences, SlotPool


def test_slot_pool_hands_out_lowest_slots_and_refuses_when_full() -> None:
    pool = SlotPool(6, first=10)
    assert pool.allocate("a", 2) == [10, 11]
    assert pool.allocate("b", 3) == [12, 13, 14]
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(OverloadedError, match="2 slots needed, 1 of 6 free"):
        pool.allocate("c", 2)
    assert (pool.release("a"), pool.release("a"), pool.in_use) == (2, 0, 3)
    assert pool.allocate("c", 3) == [10, 11, 15]
    assert sorted(pool.owners()) == ["b", "c"]


def test_a_late_fence_quarantines_its_slots_until_posted_never_a_timed_free() -> None:
    async def scenario():
        board = FenceBoard.create(2, "pddtest-fence")
        fences = Fences(board, timeout_s=0.2)
        fences.start()
        released: list[str] = []
        a, b = fences.take(), fences.take()
        with pytest.raises(OverloadedError):
            fences.take()
        fences.watch(a, lambda: released.append("a"))
        fences.watch(b, lambda: released.append("b"))
        board.post(a.index, a.ticket)
        await asyncio.sleep(0.05)
        after_post = (list(released), fences.stall_reason())
        await asyncio.sleep(0.4)  # b is not posted within 0.2 s: the engine counts as stalled
        stalled = (list(released), fences.stall_reason(), fences.outstanding)
        board.post(b.index, b.ticket)  # the engine answers after all
        await asyncio.sleep(0.05)
        answered = (list(released), fences.stall_reason(), fences.outstanding)
        await fences.stop()
        board.close()
        board.unlink()
        return after_post, stalled, answered

    after_post, stalled, answered = asyncio.run(scenario())
    assert after_post == (["a"], None)
    assert stalled[0] == ["a"] and stalled[2] == 1  # b's slots still held
    assert stalled[1].startswith("engine core stalled: 1 KV fence(s) not posted")
    assert answered == (["a", "b"], None, 0)


def test_fences_of_a_gone_engine_are_released_at_stop() -> None:
    async def scenario():
        board = FenceBoard.create(1, "pddtest-fence")
        fences = Fences(board, timeout_s=0.01)
        fences.start()
        released: list[str] = []
        fences.watch(fences.take(), lambda: released.append("x"))
        await asyncio.sleep(0.05)
        before = list(released)
        await fences.stop()  # the engine process has exited: nothing can touch the slots
        board.close()
        board.unlink()
        return before, released, fences.outstanding

    assert asyncio.run(scenario()) == ([], ["x"], 0)


def test_a_stale_ticket_does_not_release_a_reused_fence() -> None:
    async def scenario():
        board = FenceBoard.create(1, "pddtest-fence")
        fences = Fences(board, timeout_s=30)
        first = fences.take()
        fences.forget(first)  # never reached the engine
        second = fences.take()
        board.post(first.index, first.ticket)  # an old ticket in the same word
        released = []
        fences.watch(second, lambda: released.append(second))
        fences.check()
        before = list(released)
        board.post(second.index, second.ticket)
        fences.check()
        board.close()
        board.unlink()
        return first.index == second.index, before, released

    assert asyncio.run(scenario()) == (True, [], [FenceRef(index=0, ticket=2)])


def _result(tid: int, state: TransferState, n: int = 10, rid: str = "r") -> InboundResult:
    return InboundResult(tid, rid, state, "" if state is TransferState.DONE else "boom", n, 1)


def test_inbound_state_outcomes() -> None:
    s = InboundState()
    assert (s.terminal, s.outcome()) == (False, ("pending", ""))
    s.seen(1, "r")
    s.seen(2, "r")
    s.finish(_result(1, TransferState.DONE))
    assert s.outcome() == ("pending", "")
    s.finish(_result(2, TransferState.FAILED))
    assert (s.terminal, s.done, s.outcome(), s.bytes_received) == (
        True, False, ("failed", "boom"), 20,
    )  # fmt: skip
    s.seen(1, "r")  # a late chunk of a reported transfer does not reopen it
    assert s.open == set()
    c = InboundState(cancelled="router said so")
    assert (c.terminal, c.outcome()) == (True, ("cancelled", "router said so"))


def test_a_streamed_send_is_pending_until_its_last_part_landed() -> None:
    """P streaming while it prefills sends parts one after the other: the KV is there only
    once the part that says it is the last (and every one before it) ended; a failed part
    ends it at once (P sends nothing after it)."""
    more, last = wire_id("kv", "key", None), wire_id("kv", "key", 3)
    assert (split_wire_id(more), split_wire_id(last)) == (("kv", "key"), ("kv", "key"))
    assert (parts_of(more), parts_of(last), parts_of(wire_id("kv", "key"))) == (None, 3, 1)
    assert wire_id("kv", "", 1) == "kv" and split_wire_id(wire_id("kv", "", None)) == ("kv", "")
    s = InboundState()
    for tid in (1, 2):  # two earlier parts landed; nothing open in between
        s.seen(tid, more)
        s.finish(_result(tid, TransferState.DONE, rid=more))
        assert (s.never_seen, s.terminal, s.outcome()) == (False, False, ("pending", ""))
    s.seen(3, last)
    s.finish(_result(3, TransferState.DONE, rid=last))
    assert (s.terminal, s.done, s.outcome(), s.bytes_received) == (True, True, ("done", ""), 30)
    cut = InboundState()
    cut.seen(1, more)
    cut.finish(_result(1, TransferState.FAILED, rid=more))
    assert (cut.terminal, cut.done, cut.outcome()) == (True, False, ("failed", "boom"))


class _ReadyEngine:
    ready = True
    kv_geometry = None

    def validate(self, prompt, spec) -> None:
        return None


def _serve(engine, metrics):
    worker = WorkerConfig(id="w", role="colocated")
    role = PlainRole(RoleContext(engine, None, worker, PddConfig(), 32, 0))
    service = WorkerService(engine, worker, "m", metrics, role)
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    return service, server, port


def test_service_refuses_kv_work_a_colocated_worker_does_not_do() -> None:
    metrics = WorkerMetrics("colocated", lambda: None)

    async def scenario():
        _, server, port = _serve(_ReadyEngine(), metrics)
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.WorkerStub(ch)
                for call in (
                    stub.SendKv(pb.SendKvRequest(kv_request_id="x")),
                    stub.AwaitKv(pb.AwaitKvRequest(kv_request_id="x")),
                    stub.DrcEvents(pb.DrcEventsRequest(since=-1)),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    codes.append((info.value.code(), info.value.details()))
                req = pb.GenerateRequest(
                    request_id="g", prompt_token_ids=[1, 2], sampling=pb.SamplingParams(),
                    kv_stage=True,
                )  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [r async for r in stub.Generate(req)]
                codes.append((info.value.code(), info.value.details()))
        finally:
            await server.stop(0)
        return codes

    try:
        codes = asyncio.run(scenario())
    finally:
        metrics.close()
    assert codes == [
        (grpc.StatusCode.UNIMPLEMENTED, "worker w (role colocated) does not serve SendKv"),
        (grpc.StatusCode.UNIMPLEMENTED, "worker w (role colocated) does not serve AwaitKv"),
        (grpc.StatusCode.UNIMPLEMENTED, "worker w (role colocated) does not serve DrcEvents"),
        (grpc.StatusCode.FAILED_PRECONDITION, "worker w (role colocated) cannot serve kv_stage"),
    ]


def test_health_probe_is_503_until_ready_then_200() -> None:
    state = {"ready": False}
    metrics = WorkerMetrics(
        "prefill", lambda: None, lambda: KvStats(pinned_slots=3), lambda: state["ready"]
    )
    try:
        port = metrics.serve("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/health"
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url, timeout=5)
        assert info.value.code == 503
        state["ready"] = True
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert (resp.status, resp.read()) == (200, b"ok\n")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b'pdd_worker_ready{role="prefill"} 0.0' in body
    finally:
        metrics.close()
    for name in ("pdd_worker_requests", "pdd_worker_prompt_tokens_received",
                 "pdd_worker_prompt_refs"):  # fmt: skip
        assert name not in REGISTRY._names_to_collectors  # noqa: SLF001
