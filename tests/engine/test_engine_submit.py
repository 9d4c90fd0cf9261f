"""Engine's submission to vLLM is atomic with respect to cancellation (``_add_whole``).

A fake AsyncLLM stands in for vLLM (no engine starts): its ``add_request`` awaits like the
real one (the prompt goes to a thread pool), so a caller's cancellation lands mid-add.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.engine.engine import _add_whole
from pdd.errors import InvalidRequestError


class FakeQueue:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeLLM:
    """What the engine core received, in order: ("add", internal id) and ("abort", ids)."""

    errored = False

    def __init__(self, add_error: Exception | None = None) -> None:
        self.core: list[tuple[str, str]] = []
        self.queues: list[FakeQueue] = []
        self.entered = asyncio.Event()
        self.proceed = asyncio.Event()
        self._add_error = add_error

    async def add_request(self, request_id: str, prompt, params) -> FakeQueue:
        self.entered.set()
        await self.proceed.wait()  # vLLM: process_inputs on the renderer's thread pool
        if self._add_error is not None:
            raise self._add_error
        queue = FakeQueue(f"{request_id}-internal")
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
