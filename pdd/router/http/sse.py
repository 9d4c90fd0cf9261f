"""Server-sent events that own their source, and client-disconnect handling.

Starlette's StreamingResponse neither closes its body iterator nor notices a disconnect while
the iterator waits (for a slow first token, say). ``EventStreamResponse`` runs the body in a
task next to a disconnect listener; whichever ends first cancels the other, and the body
iterator is always closed, so the request's ``finally`` blocks (Abort to the worker, record,
admission slot) run on every path.

``cancel_on_disconnect`` does the same for work done before a response starts (the first
token of a stream, a whole non-streamed completion).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """Control flow, not an error: the client closed the connection; nobody to answer."""


def sse_event(body: Mapping[str, Any]) -> bytes:
    return (
        b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected("client disconnected")
    return task.result()


class EventStreamResponse(Response):
    """``text/event-stream`` response over an async iterator of ready-made SSE bytes."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: Mapping[str, str] | None = None):
        self._events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, watcher):
                task.cancel()
            await asyncio.gather(body, watcher, return_exceptions=True)
            await self._events.aclose()  # type: ignore[attr-defined]
        failure = None if body.cancelled() else body.exception()
        if failure is not None and not isinstance(failure, OSError | ClientDisconnect):
            raise failure  # a bug in the stream, not the client leaving: let the server log it

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self._events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def merged(
    sources: list[AsyncIterator[T]], start: Callable[[int], None] | None = None
) -> AsyncIterator[tuple[int, T]]:
    """``(i, item)`` from every source as each comes (one source: in place, no task). Each
    of several sources runs in a task of its own (``start(i)`` first, e.g. to bind its logs);
    the first failure is raised here, and on every exit each source is cancelled and closed.
    """
    if len(sources) == 1:
        async with aclosing(sources[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator[T]) -> None:
        if start is not None:
            start(i)
        try:
            async with aclosing(source):  # type: ignore[type-var]
                async for item in source:
                    queue.put_nowait((i, item, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:  # raised to the reader, which cancels the rest
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        running = len(tasks)
        while running:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                running -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
