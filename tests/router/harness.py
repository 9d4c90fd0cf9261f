"""Runs the real router (app + uvicorn on a free port) wired to fake workers, in one
background thread with its own event loop, so tests can use the blocking `openai` client and
httpx against a real HTTP server. ``start()`` waits for the ready callback and a healthy
fleet, each with a deadline; ``stop()`` shuts the servers down and joins the thread.

``RouterHarness(codec)`` is one colocated fake ("w0"); ``RouterHarness.pdd(codec, mode)``
is a PDD fleet: P and RLD in dc-a, MD in dc-b (plus a dc-a main_decode "dl" for pd_local),
linked by one ``FakeKvPlane``.
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
from pdd.router.text.tokenizer import TextCodec
from tests.router.fake_kv import FakeKvPlane
from tests.router.fake_worker import FakeWorker, start_fake_worker

MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 65536
MAX_QUEUED = 4
DATACENTER = {"prefill": "dc-a", "relay_decode": "dc-a", "main_decode": "dc-b"}


def test_config(
    workers: list[dict[str, Any]], security: dict[str, Any] | None = None, **router: Any
) -> PddConfig:
    return PddConfig.model_validate(
        {
            "security": security or {},
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
            "workers": workers,
        }
    )


class RouterHarness:
    def __init__(
        self,
        codec: TextCodec,
        fakes: list[FakeWorker] | None = None,
        plane: FakeKvPlane | None = None,
        security: dict[str, Any] | None = None,
        **router: Any,
    ):
        self.codec = codec
        self.fakes = fakes or [FakeWorker("w0", MAX_MODEL_LEN)]
        self.fake = self.fakes[0]
        self.plane = plane
        self.datacenters: dict[str, str] = {}
        self.router_overrides = router
        self.security = security
        self.cfg: PddConfig | None = None
        self.url = ""  # http://127.0.0.1:PORT/v1
        self.fake_target = ""  # the first fake worker's gRPC address
        self._server: RouterServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="router-harness", daemon=True)

    @classmethod
    def pdd(cls, codec: TextCodec, mode: str = "pdd", **policy: Any) -> RouterHarness:
        """P, RLD, MD (and a dc-a main_decode "dl") sharing one fake KV plane."""
        plane = FakeKvPlane()
        fakes = [
            FakeWorker("p0", MAX_MODEL_LEN, "prefill", plane),
            FakeWorker("rld0", MAX_MODEL_LEN, "relay_decode", plane),
            FakeWorker("md0", MAX_MODEL_LEN, "main_decode", plane),
            FakeWorker("dl0", MAX_MODEL_LEN, "main_decode", plane),
        ]
        fakes[0].wan_bandwidth_bps = 8000.0  # P measured a slow WAN: 1 s per 1000-byte block
        h = cls(codec, fakes, plane, mode=mode, pdd=policy)
        h.datacenters = {"dl0": "dc-a"}
        if mode == "pdd":  # the dc-a main_decode only serves the baselines
            h.fakes = fakes[:3]
        return h

    def by_id(self, worker_id: str) -> FakeWorker:
        return next(f for f in self.fakes if f.worker_id == worker_id)

    def reset(self) -> None:
        for f in self.fakes:
            f.reset()
        if self.plane is not None:
            self.plane.reset()

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError(f"router harness did not start: {self._error!r}")
        self.wait_health(200, timeout)
        self.wait_all_healthy(timeout)

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

    def workers(self) -> list[dict[str, Any]]:
        return httpx.get(self.root + "/debug/workers", timeout=2.0).json()["workers"]

    def wait_all_healthy(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(w["healthy"] for w in self.workers()):
                return
            time.sleep(0.02)
        raise TimeoutError(f"workers not all healthy: {self.workers()}")

    def wait_drc_synced(self, timeout: float = 10.0) -> None:
        """Until the router's DRC view of every MD fake is at the fake's newest event."""
        if self.cfg is None or self.cfg.router.mode.value != "pdd":
            return  # only mode pdd keeps DRC views
        mds = {f.worker_id: f for f in self.fakes if f.role == "main_decode" and f.kv}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            views = {w["id"]: w.get("drc") for w in self.workers() if w["id"] in mds}
            if all(
                v is not None and not v["stale"] and v["seq"] == len(mds[i].kv.events)  # type: ignore[union-attr]
                for i, v in views.items()
            ):
                return
            time.sleep(0.02)
        raise TimeoutError(f"DRC views not in sync: {self.workers()}")

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
        servers, workers = [], []
        try:
            for fake in self.fakes:
                server, port = await start_fake_worker(fake)
                servers.append(server)
                dc = self.datacenters.get(fake.worker_id, DATACENTER.get(fake.role, "dc-a"))
                workers.append(
                    {"id": fake.worker_id, "role": fake.role, "port": port, "datacenter": dc}
                )
            self.fake_target = f"127.0.0.1:{workers[0]['port']}"
            self.cfg = test_config(workers, self.security, **self.router_overrides)
            app = build_app(self.cfg, codec=self.codec)
            self._server = RouterServer(app, bind_socket("127.0.0.1", 0), on_ready=self._on_ready)
            await self._server.serve()
        finally:
            for server in servers:
                await server.stop(None)

    def _on_ready(self, url: str) -> None:
        self.url = url
        self._ready.set()
