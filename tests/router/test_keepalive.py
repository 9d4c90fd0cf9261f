"""gRPC keepalive between the router's channels and the workers' servers (pdd.proto.options):
a stream that sends nothing for longer than three ping intervals survives (workers accept the
pings), and a worker frozen mid-stream (SIGSTOP: sockets open, nobody answering) fails the
stream with UNAVAILABLE within about keepalive + timeout, so recovery can take over instead of
waiting for the request's deadline."""

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
from pdd.proto.options import CHANNEL_OPTIONS, KEEPALIVE_S, KEEPALIVE_TIMEOUT_S, SERVER_OPTIONS

pytestmark = pytest.mark.slow


class _Slow(worker_pb2_grpc.WorkerServicer):
    """Generate: three responses, each after ``request_id`` seconds of silence."""

    async def Generate(self, request, context):  # noqa: N802
        for i in range(3):
            await asyncio.sleep(float(request.request_id))
            yield worker_pb2.GenerateResponse(token_ids=[i])


def _serve(port: int) -> None:
    async def main() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        worker_pb2_grpc.add_WorkerServicer_to_server(_Slow(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
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


@pytest.fixture
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
