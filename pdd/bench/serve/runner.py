"""Offers a workload to one running system: phases, arrivals, ordering, deadlines, progress.

Per group, in order: the warm-up requests (closed loop at ``load.concurrency``), then the
measured ones: open loop (Poisson arrivals at ``load.rate``, seeded per group, so every mode
gets the same schedule), closed loop (``load.concurrency`` streams), or the trace's own
timestamps. A request waits for the request named by its ``after`` to end. No request is sent
after ``load.duration_s`` into a phase (it counts as not sent); each one sent has
``load.request_timeout_s``. Owns one ``httpx.AsyncClient`` per mode (``run_mode``).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TextIO

import httpx

from pdd.bench.serve.client import RequestRecord, fetch_debug, stream_request
from pdd.bench.serve.config import BenchConfig
from pdd.bench.serve.link import LinkMeter
from pdd.bench.serve.results import PhaseResult
from pdd.bench.serve.workload import BenchRequest, Workload
from pdd.errors import PddError


class Progress:
    """A progress line per phase: tqdm on a terminal when installed, else a line every
    ``interval_s`` seconds (readable in CI logs)."""

    def __init__(self, interval_s: float, stream: TextIO = sys.stderr):
        self.interval_s = interval_s
        self.stream = stream
        self.label = ""
        self.total = self.done = self.errors = 0
        self.t0 = 0.0
        self._bar: Any = None
        self._task: asyncio.Task[None] | None = None

    def begin(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.errors = label, total, 0, 0
        self.t0 = time.monotonic()
        if self.stream.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=label, file=self.stream, leave=False)
                return
            except ImportError:
                pass
        self._task = asyncio.create_task(self._tick())

    def finished(self, ok: bool) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(errors=self.errors)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self.t0
        print(
            f"[bench] {self.label}: {self.done}/{self.total} done, {self.errors} errors, "
            f"{elapsed:.0f}s",
            file=self.stream,
            flush=True,
        )

    async def end(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._line()


def poisson_offsets(rate: float, n: int, rng: random.Random) -> list[float]:
    """Arrival offsets (s) of a Poisson process: exponential gaps of mean 1/rate."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


_Send = Callable[[BenchRequest], Awaitable[None]]


class PhaseRunner:
    """Runs the phases of workloads against one base URL with one HTTP client."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        cfg: BenchConfig,
        model: str,
        progress: Progress,
        meter: LinkMeter | None = None,
    ):
        self.http = http
        self.cfg = cfg
        self.model = model
        self.progress = progress
        self.meter = meter
        self.root = str(http.base_url).rstrip("/").removesuffix("/v1")

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body = dict(req.payload(), model=self.model, temperature=self.cfg.temperature)
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def run(self, wl: Workload, label: str) -> list[PhaseResult]:
        done = {r.index: asyncio.Event() for r in wl.requests}
        phases: list[PhaseResult] = []
        for group in wl.groups:
            for warmup in (True, False):
                reqs = wl.phase(group.name, warmup)
                if not reqs:
                    continue
                name = f"{label} {group.name} {'warm-up' if warmup else 'measured'}"
                phases.append(await self._phase(reqs, done, warmup, name))
        return phases

    async def _phase(
        self, reqs: list[BenchRequest], done: dict[int, asyncio.Event], warmup: bool, name: str
    ) -> PhaseResult:
        records: list[RequestRecord] = []
        start = time.perf_counter()
        deadline = start + self.cfg.load.duration_s
        ends = [start]
        not_sent = 0

        async def one(req: BenchRequest) -> None:
            nonlocal not_sent
            try:
                if req.after is not None:
                    await done[req.after].wait()
                if time.perf_counter() > deadline:
                    not_sent += 1
                    return
                rec = await stream_request(
                    self.http, req, self.body(req), self.cfg.load.request_timeout_s, start
                )
                ends.append(time.perf_counter())
                if self.cfg.timelines:
                    await fetch_debug(self.http, self.root, rec)
                records.append(rec)
                self.progress.finished(rec.ok)
            finally:
                done[req.index].set()

        meter = None if warmup else self.meter
        link_before = await asyncio.to_thread(meter.read) if meter else None
        self.progress.begin(name, len(reqs))
        try:
            offsets = None if warmup else self._offsets(reqs, reqs[0].group)
            if offsets is None:
                await self._closed(reqs, one)
            else:
                await self._scheduled(reqs, offsets, start, one)
        finally:
            await self.progress.end()
        records.sort(key=lambda r: r.index)
        if offsets is not None:
            scheduled = {r.index: t for r, t in zip(reqs, offsets, strict=True)}
            for rec in records:
                rec.scheduled_s = scheduled[rec.index]
        link = None
        if meter is not None and link_before is not None:
            link = await asyncio.to_thread(meter.read) - link_before
        return PhaseResult(reqs[0].group, warmup, records, max(ends) - start, not_sent, link)

    def _offsets(self, reqs: list[BenchRequest], group: str) -> list[float] | None:
        if all(r.arrival_s is not None for r in reqs):
            return [float(r.arrival_s or 0.0) for r in reqs]  # trace replay
        if self.cfg.load.pattern == "closed":
            return None
        rng = random.Random(f"arrivals-{self.cfg.seed}-{group}")
        return poisson_offsets(self.cfg.load.rate, len(reqs), rng)

    async def _closed(self, reqs: Sequence[BenchRequest], one: _Send) -> None:
        queue = list(reversed(reqs))  # taken in index order, so a dependency is always taken first

        async def stream_worker() -> None:
            while queue:
                await one(queue.pop())

        await asyncio.gather(*(stream_worker() for _ in range(self.cfg.load.concurrency)))

    async def _scheduled(
        self, reqs: Sequence[BenchRequest], offsets: Sequence[float], start: float, one: _Send
    ) -> None:
        slots = asyncio.Semaphore(self.cfg.load.max_in_flight)

        async def arrive(req: BenchRequest, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with slots:
                await one(req)

        await asyncio.gather(*(arrive(r, t) for r, t in zip(reqs, offsets, strict=True)))


def api_base(url: str) -> str:
    """``http://h:p`` or ``http://h:p/v1`` -> ``http://h:p/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def wait_healthy(http: httpx.AsyncClient, root: str, timeout_s: float) -> None:
    """Poll ``GET {root}/health`` until 200 (a server without /health, 404, is taken as ready).
    `pdd ready` can come before the router has seen a healthy worker."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            resp = await http.get(root + "/health", timeout=10)
            if resp.status_code in (200, 404):
                return
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.25)
    raise PddError(f"{root}/health did not answer 200 within {timeout_s:.0f}s (last: {last})")


async def discover(http: httpx.AsyncClient, model: str | None) -> tuple[str, int | None]:
    """(model name to send, the server's max_model_len if it says) from ``GET /models``."""
    try:
        resp = await http.get("/models", timeout=30)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise PddError(f"GET /models failed: {exc}") from exc
    if model is None:
        if not data:
            raise PddError("GET /models lists no model")
        model = str(data[0]["id"])
    entry = next((m for m in data if m.get("id") == model), {})
    max_len = entry.get("max_model_len")
    return model, int(max_len) if max_len else None


async def run_mode(
    cfg: BenchConfig,
    url: str,
    workloads: dict[str, Workload],
    label: str,
    transport: httpx.AsyncBaseTransport | None = None,
    api_key: str | None = None,
) -> dict[str, list[PhaseResult]]:
    """Every workload, in order, against the server at ``url`` (``transport``: tests only;
    ``api_key``: sent as a Bearer key on every request).
    Raises PddError when the server cannot be asked or a workload does not fit its context."""
    load = cfg.load
    limits = httpx.Limits(max_connections=max(load.concurrency, load.max_in_flight) + 4)
    timeout = httpx.Timeout(load.request_timeout_s, connect=10.0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(
        base_url=api_base(url), limits=limits, timeout=timeout, transport=transport,
        headers=headers,
    ) as http:  # fmt: skip
        await wait_healthy(http, api_base(url).removesuffix("/v1"), cfg.serve_ready_timeout_s)
        model, max_len = await discover(http, cfg.model)
        for wl in workloads.values():
            need = wl.max_context()
            if max_len is not None and need > max_len:
                raise PddError(
                    f"workload {wl.name} needs {need} tokens of context (prompt + max_tokens) "
                    f"but the server's max_model_len is {max_len}: shrink the workload "
                    f"(prompt/output token settings) or raise engine.max_model_len"
                )
        meter = LinkMeter(cfg.lab_prefix) if cfg.lab_prefix else None
        runner = PhaseRunner(http, cfg, model, Progress(cfg.progress_interval_s), meter)
        return {name: await runner.run(wl, f"{label} {name}") for name, wl in workloads.items()}
