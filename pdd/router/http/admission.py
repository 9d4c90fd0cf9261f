"""The end-to-end request deadline (``router.request_timeout_s``).

    with_deadline(deltas, deadline, timeout_s) -> the same deltas, or RequestTimeoutError

Admission itself (a bounded count of requests in flight, 429 above) is ``RouterService``'s;
this module bounds how long an admitted request may run, across every worker call it makes
(prefill, relay, handoff, KV waits): each wait for the next delta gets the time left. When it
runs out, the wait is cancelled inside the request's generator, whose ``finally`` blocks
cancel the gRPC streams and send Abort to the workers, and ``RequestTimeoutError`` (504)
reaches the API layer: an error response before the first token, an error event then
``[DONE]`` mid-stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TypeVar

from pdd.errors import PddError, RequestTimeoutError

T = TypeVar("T")


async def with_deadline(
    source: AsyncIterator[T], deadline: float, timeout_s: float
) -> AsyncIterator[T]:
    """Yield ``source``'s items until it ends or ``time.monotonic()`` passes ``deadline``.

    Closes ``source`` on every path. A worker's own deadline error (``code == "timeout"``)
    that fires at our deadline is reported as ours, so the client sees one kind of timeout.
    """
    async with aclosing(source):  # type: ignore[type-var]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timed_out(timeout_s)
            timer = asyncio.timeout(left)
            try:
                async with timer:
                    item = await anext(source)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not timer.expired():
                    raise
                raise _timed_out(timeout_s) from None
            except PddError as exc:
                if exc.code == "timeout" and time.monotonic() >= deadline:
                    raise _timed_out(timeout_s) from None
                raise
            yield item


def _timed_out(timeout_s: float) -> RequestTimeoutError:
    return RequestTimeoutError(
        f"The request did not finish within the server's deadline of {timeout_s:g} s "
        "(router.request_timeout_s)."
    )
