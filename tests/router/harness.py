"""Runs the real router (app + uvicorn on a free port) wired to a FakeWorker, in one
background thread with its own event loop, so tests can use the blocking `openai` client and
httpx against a real HTTP server. ``start()`` waits for the ready callback and a healthy
worker, each with a deadline; ``stop()`` shuts both servers down and joins the thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx

from pdd.config import PddConfig
from pdd.router.app import build_app
from pdd.router.main import RouterServer, bind_socket
from pdd.router.tokenizer import TextCodec
from tests.router.fake_worker import FakeWorker, start_fake_worker

MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 65536
MAX_QUEUED = 4


def test_config(worker_port: int, **router: Any) -> PddConfig:
    return PddConfig.model_validate(
        {
            "engine": {"max_model_len": MAX_MODEL_LEN},
            "router": {
                "host": "127.0.0.1",
                "port": 0,
                "max_body_bytes": MAX_BODY_BYTES,
                "max_queued_requests": MAX_QUEUED,
                "health_interval_s": 0.05,
                "worker_rpc_timeout_s": 1.0,
                "request_timeout_s": 30.0,
                **router,
            },
            "workers": [{"id": "w0", "role": "colocated", "port": worker_port}],
        }
    )


class RouterHarness:
    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.fake = FakeWorker("w0", MAX_MODEL_LEN)
        self.cfg: PddConfig | None = None
        self.url = ""  # http://127.0.0.1:PORT/v1
        self.fake_target = ""  # the fake worker's gRPC address
        self._server: RouterServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="router-harness", daemon=True)

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError(f"router harness did not start: {self._error!r}")
        self.wait_health(200, timeout)

    def wait_health(self, status: int, timeout: float = 10.0) -> None:
        """Poll /health until it answers ``status`` (deadline, no fixed sleeps)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = httpx.get(self.root + "/health", timeout=2.0).status_code
            if last == status:
                return
            time.sleep(0.02)
        raise TimeoutError(f"/health stayed {last}, wanted {status}")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "router harness thread did not stop"

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start(); the thread must not die silently
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        grpc_server, port = await start_fake_worker(self.fake)
        self.fake_target = f"127.0.0.1:{port}"
        try:
            self.cfg = test_config(port)
            app = build_app(self.cfg, codec=self.codec)
            self._server = RouterServer(app, bind_socket("127.0.0.1", 0), on_ready=self._on_ready)
            await self._server.serve()
        finally:
            await grpc_server.stop(None)

    def _on_ready(self, url: str) -> None:
        self.url = url
        self._ready.set()
