"""Engine's submission to vLLM is atomic with respect to cancellation (``_add_whole``).

A fake AsyncLLM stands in for vLLM (no engine starts): its ``add_request`` awaits like the
real one (the prompt goes to a thread pool), so a caller's cancellation lands mid-add.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.config import EngineConfig, ModelConfig
from pdd.engine.engine import Engine, _add_whole
from pdd.engine.types import SamplingSpec
from pdd.errors import InvalidRequestError, WorkerError


class FakeQueue:
    """vLLM's RequestOutputCollector: here it only ever yields ``error`` (if any)."""

    def __init__(self, request_id: str, error: Exception | None = None) -> None:
        self.request_id = request_id
        self.closed = False
        self._error = error

    def get_nowait(self):
        if self._error is not None:
            raise self._error
        return None

    async def get(self):
        await asyncio.Event().wait()  # no output ever comes

    def close(self) -> None:
        self.closed = True


class FakeLLM:
    """What the engine core received, in order: ("add", internal id) and ("abort", ids)."""

    errored = False

    def __init__(
        self, add_error: Exception | None = None, output_error: Exception | None = None
    ) -> None:
        self.core: list[tuple[str, str]] = []
        self.queues: list[FakeQueue] = []
        self.entered = asyncio.Event()
        self.proceed = asyncio.Event()
        self._add_error = add_error
        self._output_error = output_error

    async def add_request(self, request_id: str, prompt, params) -> FakeQueue:
        self.entered.set()
        await self.proceed.wait()  # vLLM: process_inputs on the renderer's thread pool
        if self._add_error is not None:
            raise self._add_error
        queue = FakeQueue(f"{request_id}-internal", self._output_error)
        self.queues.append(queue)
        self.core.append(("add", queue.request_id))
        return queue

    async def abort(self, request_id: str, internal: bool = False) -> None:
        assert internal
        self.core.append(("abort", request_id))


async def _cancel_mid_add(llm: FakeLLM) -> asyncio.Task:
    task = asyncio.ensure_future(_add_whole(llm, "r1", {"prompt_token_ids": [1]}, None))
    await llm.entered.wait()
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # the cancel waits for the add, it does not abandon it
    task.cancel()  # a second cancel changes nothing
    await asyncio.sleep(0)
    llm.proceed.set()
    return task


def test_a_cancel_mid_add_waits_for_the_add_then_aborts_it() -> None:
    async def go():
        llm = FakeLLM()
        task = await _cancel_mid_add(llm)
        with pytest.raises(asyncio.CancelledError):
            await task
        return llm

    llm = asyncio.run(go())
    assert llm.core == [("add", "r1-internal"), ("abort", "r1-internal")]
    assert llm.queues[0].closed


def test_an_add_refused_mid_cancel_says_the_core_never_saw_it() -> None:
    async def go():
        llm = FakeLLM(add_error=ValueError("bad params"))
        task = await _cancel_mid_add(llm)
        with pytest.raises(InvalidRequestError, match="bad params"):
            await task
        return llm

    assert asyncio.run(go()).core == []


def test_an_uncancelled_add_returns_its_queue() -> None:
    async def go():
        llm = FakeLLM()
        llm.proceed.set()
        queue = await _add_whole(llm, "r2", {"prompt_token_ids": [1]}, None)
        return llm, queue

    llm, queue = asyncio.run(go())
    assert (llm.core, queue.request_id, queue.closed) == (
        [("add", "r2-internal")],
        "r2-internal",
        False,
    )


def _engine(llm: FakeLLM) -> Engine:
    engine = Engine(ModelConfig(), EngineConfig())
    engine._llm = llm  # a started engine, as far as generate() is concerned
    return engine


async def _first(engine: Engine, rid: str) -> None:
    async for _ in engine.generate(rid, [5, 6, 7], SamplingSpec(max_tokens=2)):
        pass


def test_engine_generate_cancelled_mid_add_aborts_the_added_request() -> None:
    async def go():
        llm = FakeLLM()
        engine = _engine(llm)
        task = asyncio.ensure_future(_first(engine, "g1"))
        await llm.entered.wait()
        task.cancel()
        await asyncio.sleep(0)
        llm.proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return llm, engine.stats().running

    llm, running = asyncio.run(go())
    assert llm.core == [("add", "g1-internal"), ("abort", "g1-internal")]
    assert running == 0


def test_an_error_after_the_add_is_a_worker_error_never_invalid_request() -> None:
    """InvalidRequestError means "the engine core never saw it" (kv_run frees the fence at
    once on it): an error out of the output queue, after the add, must not say so."""

    async def go():
        llm = FakeLLM(output_error=ValueError("broken output"))
        llm.proceed.set()
        with pytest.raises(WorkerError, match="broken output"):
            await _first(_engine(llm), "g2")
        return llm

    assert asyncio.run(go()).core == [("add", "g2-internal"), ("abort", "g2-internal")]
