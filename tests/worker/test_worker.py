"""A real worker process (real vLLM, default model) driven over gRPC. One process per module."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest

from pdd.proto import worker_pb2 as pb
from pdd.proto import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PARIS_PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
PARIS, PERIOD = 7042, 30
MAX_MODEL_LEN = 1024
READY_PREFIX = "pdd worker ready: "


@dataclass
class Worker:
    proc: subprocess.Popen
    grpc_addr: str = ""
    metrics_addr: str = ""
    lines: list[str] = field(default_factory=list)


def start_worker(log_path: Path, timeout_s: float = 300) -> Worker:
    args = [sys.executable, "-m", "pdd.launch.worker", "--config", "configs/colocated.yaml"]
    args += ["--worker", "w0"]
    for kv in (
        "engine.kv_cache_space_gib=0.25",
        f"engine.max_model_len={MAX_MODEL_LEN}",
        "workers.0.port=0",
        "workers.0.metrics_port=0",
        "workers.0.drain_timeout_s=1",  # SIGTERM: in-flight requests get 1 s, then abort
    ):
        args += ["--set", kv]
    log = log_path.open("w")
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ)
    )
    log.close()
    worker = Worker(proc)
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            worker.lines.append(line.rstrip("\n"))
            if line.startswith(READY_PREFIX):
                fields = dict(kv.split("=", 1) for kv in line[len(READY_PREFIX) :].split())
                worker.grpc_addr, worker.metrics_addr = fields["grpc"], fields["metrics"]
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"worker not ready:\n{log_path.read_text()[-3000:]}")
    return worker


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = start_worker(tmp_path_factory.mktemp("worker") / "worker.log")
    try:
        yield w
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


def call(worker: Worker, fn):
    """Run ``fn(stub)`` (a coroutine function) on a fresh channel with a deadline."""

    async def go():
        async with grpc.aio.insecure_channel(worker.grpc_addr) as ch:
            return await asyncio.wait_for(fn(pb_grpc.WorkerStub(ch)), timeout=120)

    return asyncio.run(go())


def sampling(**kw) -> pb.SamplingParams:
    kw.setdefault("logprobs", -1)
    return pb.SamplingParams(temperature=0, **kw)


async def generate(stub, rid: str, prompt: list[int], params: pb.SamplingParams):
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=params)
    return [r async for r in stub.Generate(req, timeout=60)]


async def running(stub) -> int:
    return (await stub.Stats(pb.StatsRequest(), timeout=5)).running_requests


async def until_idle(stub, timeout_s: float = 10) -> int:
    """Poll Stats until nothing runs (abort propagates asynchronously); returns the count."""
    deadline = time.monotonic() + timeout_s
    while (n := await running(stub)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return n


def test_health_reports_ready(worker: Worker) -> None:
    h = call(worker, lambda s: s.Health(pb.HealthRequest(), timeout=5))
    assert (h.ready, h.worker_id, h.role, h.model) == (
        True,
        "w0",
        "colocated",
        "SmolLM2-135M-Instruct",
    )
    assert [ln for ln in worker.lines if ln.startswith("pdd worker ready")] == worker.lines


def test_stats_describe_the_engine(worker: Worker) -> None:
    s = call(worker, lambda stub: stub.Stats(pb.StatsRequest(), timeout=5))
    assert (s.worker_id, s.role, s.running_requests, s.waiting_requests) == (
        "w0",
        "colocated",
        0,
        0,
    )
    assert (s.max_model_len, s.block_size, s.max_num_seqs) == (MAX_MODEL_LEN, 32, 32)
    assert s.kv_block_bytes == 46_080 * 32  # SmolLM2 float32: 46,080 bytes of KV per token


def test_generate_greedy_paris(worker: Worker) -> None:
    resps = call(worker, lambda s: generate(s, "paris", PARIS_PROMPT, sampling(max_tokens=2)))
    assert [t for r in resps for t in r.token_ids] == [PARIS, PERIOD]
    assert (resps[0].num_prompt_tokens, resps[0].num_cached_tokens) == (5, 0)
    assert resps[-1].finish_reason == "length"
    assert resps[-1].stop_token_id == -1
    assert all(r.finish_reason == "" for r in resps[:-1])


def test_generate_stops_on_stop_token(worker: Worker) -> None:
    params = sampling(max_tokens=8, stop_token_ids=[PERIOD])
    resps = call(worker, lambda s: generate(s, "stop", PARIS_PROMPT, params))
    assert [t for r in resps for t in r.token_ids] == [PARIS, PERIOD]
    assert (resps[-1].finish_reason, resps[-1].stop_token_id) == ("stop", PERIOD)


def test_logprobs(worker: Worker) -> None:
    params = sampling(max_tokens=3, logprobs=2)
    resps = call(worker, lambda s: generate(s, "lp", PARIS_PROMPT, params))
    lps = [lp for r in resps for lp in r.logprobs]
    assert [lp.token_id for lp in lps] == [t for r in resps for t in r.token_ids]
    assert all(len(lp.top) == 2 and lp.top[0].token_id == lp.token_id for lp in lps)
    plain = call(worker, lambda s: generate(s, "nolp", PARIS_PROMPT, sampling(max_tokens=3)))
    assert all(len(r.logprobs) == 0 for r in plain)


def test_abort_mid_stream(worker: Worker) -> None:
    async def scenario(stub):
        params = sampling(max_tokens=2000, ignore_eos=True)
        req = pb.GenerateRequest(request_id="ab", prompt_token_ids=PARIS_PROMPT, sampling=params)
        got = []
        async for r in stub.Generate(req, timeout=60):
            got.append(r)
            if len(got) == 2:
                assert await running(stub) == 1
                found = await stub.Abort(pb.AbortRequest(request_id="ab"), timeout=5)
                assert found.found is True
        return got, await running(stub)

    got, left = call(worker, scenario)
    assert got[-1].finish_reason == "abort"
    assert left == 0
    again = call(worker, lambda s: s.Abort(pb.AbortRequest(request_id="ab"), timeout=5))
    assert again.found is False


def test_cancelled_stream_aborts_the_request(worker: Worker) -> None:
    async def scenario(stub):
        params = sampling(max_tokens=2000, ignore_eos=True)
        req = pb.GenerateRequest(request_id="cx", prompt_token_ids=PARIS_PROMPT, sampling=params)
        stream = stub.Generate(req, timeout=60)
        async for _ in stream:
            break
        assert await running(stub) == 1
        stream.cancel()
        return await until_idle(stub)

    assert call(worker, scenario) == 0


@pytest.mark.parametrize(
    ("rid", "prompt", "params", "message"),
    [
        ("bad", [], sampling(max_tokens=4), "prompt_token_ids must not be empty"),
        ("bad", [100] * MAX_MODEL_LEN, sampling(max_tokens=4), "context"),
        ("bad", [49152], sampling(max_tokens=4), "prompt token ids must be in"),
        ("bad", PARIS_PROMPT, sampling(max_tokens=4, top_p=1.5), "top_p"),
        ("bad", PARIS_PROMPT, pb.SamplingParams(temperature=-1), "temperature"),
        ("bad", PARIS_PROMPT, sampling(max_tokens=4, logprobs=99), "logprobs"),
        ("", PARIS_PROMPT, sampling(max_tokens=4), "request_id"),
    ],
)
def test_invalid_input_is_invalid_argument(worker, rid, prompt, params, message) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        call(worker, lambda s: generate(s, rid, prompt, params))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert call(worker, running) == 0


def scrape(worker: Worker) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://{worker.metrics_addr}/metrics", timeout=5).read()
    samples = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics_endpoint(worker: Worker) -> None:
    length = 'pdd_worker_requests_total{outcome="length",role="colocated"}'
    before = scrape(worker)
    call(worker, lambda s: generate(s, "m", PARIS_PROMPT, sampling(max_tokens=3, ignore_eos=True)))
    after = scrape(worker)
    assert after[length] == before.get(length, 0) + 1
    tokens = 'pdd_worker_generation_tokens_total{role="colocated"}'
    assert after[tokens] == before[tokens] + 3
    assert after['pdd_worker_ready{role="colocated"}'] == 1
    assert after['pdd_worker_running_requests{role="colocated"}'] == 0
    assert after['pdd_worker_waiting_requests{role="colocated"}'] == 0
    assert any(name.startswith("vllm:") for name in after)  # vLLM's own metrics ride along


def test_sigterm_aborts_in_flight_and_exits_cleanly(worker: Worker) -> None:
    """Runs last: it stops the module's worker."""
    children = psutil.Process(worker.proc.pid).children(recursive=True)
    assert any(c.name().startswith("VLLM") for c in children)

    async def scenario(stub):
        params = sampling(max_tokens=2000, ignore_eos=True)
        req = pb.GenerateRequest(request_id="term", prompt_token_ids=PARIS_PROMPT, sampling=params)
        got = []
        async for r in stub.Generate(req, timeout=60):
            got.append(r)
            if len(got) == 1:
                worker.proc.send_signal(signal.SIGTERM)
        return got

    got = call(worker, scenario)
    assert got[-1].finish_reason == "abort"
    assert worker.proc.wait(timeout=60) == 0
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
