"""gRPC keepalive and reconnects between the router's channels and the workers' servers
(pdd.proto.options): a stream that sends nothing for longer than three ping intervals survives
(workers accept the pings), and a worker frozen mid-stream (SIGSTOP: sockets open, nobody
answering) fails the stream with UNAVAILABLE within about keepalive + timeout, so recovery can
take over instead of waiting for the request's deadline; a worker unreachable for half a minute
is reached again within the capped reconnect interval once it is back, not after gRPC's own
backoff (10-20 s by then, growing to two minutes)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
import time

import grpc
import pytest

from pdd.proto import worker_pb2, worker_pb2_grpc
from pdd.proto.options import (
    CHANNEL_OPTIONS,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_RECONNECT_BACKOFF_S,
    SERVER_OPTIONS,
)

pytestmark = pytest.mark.slow


class _Slow(worker_pb2_grpc.WorkerServicer):
    """Generate: three responses, each after ``request_id`` seconds of silence. Health:
    an empty answer."""

    async def Health(self, request, context):  # noqa: N802
        return worker_pb2.HealthResponse()

    async def Generate(self, request, context):  # noqa: N802
        for i in range(3):
            await asyncio.sleep(float(request.request_id))
            yield worker_pb2.GenerateResponse(token_ids=[i])


def _serve(port: int, ready=None) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        worker_pb2_grpc.add_WorkerServicer_to_server(_Slow(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        if ready is not None:
            ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


async def _stream(port: int, gap_s: float, freeze_pid: int | None = None) -> tuple[str, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        await asyncio.wait_for(ch.channel_ready(), 10)
        t0 = time.monotonic()
        call = stub.Generate(worker_pb2.GenerateRequest(request_id=str(gap_s)))
        if freeze_pid is not None:
            await asyncio.sleep(0.5)
            os.kill(freeze_pid, signal.SIGSTOP)
        try:
            got = [r async for r in call]
            return f"ok {len(got)}", time.monotonic() - t0
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, time.monotonic() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    port = _free_port()
    proc = mp.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    proc.start()
    try:
        yield port, proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.join(10)


def test_silent_stream_survives_and_frozen_worker_fails_fast(server):
    port, proc = server
    gap = KEEPALIVE_S * 1.4  # 3 gaps > 3 ping intervals: pings on a silent stream are fine
    outcome, took = asyncio.run(_stream(port, gap))
    assert outcome == "ok 3" and took >= 3 * gap
    outcome, took = asyncio.run(_stream(port, 60.0, freeze_pid=proc.pid))
    assert outcome == "UNAVAILABLE"
    assert took < KEEPALIVE_S + KEEPALIVE_TIMEOUT_S + 5


DOWN_S = 30  # gRPC's default intervals (1 s, x1.6 per attempt, +-20%) reach 10-20 s by then


def test_a_worker_back_after_a_long_outage_is_reached_within_the_capped_interval():
    """Nothing listens on the worker's port for DOWN_S seconds while a channel keeps asking
    for Health (as the router polls a worker); then the worker starts. With gRPC's default
    intervals the channel's next attempt would come 10-30 s later; with pdd's cap, within
    MAX_RECONNECT_BACKOFF_S (+20% jitter)."""
    port = _free_port()
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=_serve, args=(port, ready), daemon=True)

    async def outage_then_back() -> float:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            began, up_at = time.monotonic(), None
            while True:
                if proc.pid is None and time.monotonic() - began >= DOWN_S:
                    proc.start()
                if up_at is None and ready.is_set():
                    up_at = time.monotonic()  # listening from now on
                try:
                    await stub.Health(worker_pb2.HealthRequest(), timeout=1.0)
                    assert up_at is not None, "answered before the worker started"
                    return time.monotonic() - up_at
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.2)

    try:
        took = asyncio.run(outage_then_back())
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    assert took < MAX_RECONNECT_BACKOFF_S * 1.2 + 1.5, took
