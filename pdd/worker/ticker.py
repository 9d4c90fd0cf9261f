"""A periodic call on the worker's event loop: how roles expire leases.

Lifecycle: ``Ticker(tick, interval_s, name)`` -> ``start()`` (on the running loop) -> ``tick``
is called with ``time.monotonic()`` every ``interval_s`` -> ``await stop()`` cancels and
joins the task. ``tick`` must not block and should not raise (an exception ends the ticker).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class Ticker:
    def __init__(self, tick: Callable[[float], None], interval_s: float, name: str) -> None:
        self._tick = tick
        self._interval_s = interval_s
        self._name = name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self._tick(time.monotonic())
