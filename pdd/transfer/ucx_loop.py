"""The UCX I/O thread: the only thread that touches the ucxx worker, its endpoints and requests.

API threads hand it work with `call(fn)`; it runs those, drives UCX progress in blocking
mode (epoll with a short timeout: shared-memory transports do not signal the event fd, so
progress must also run periodically) and fires completion callbacks of posted requests.

    loop: run queued calls -> worker.progress_worker_event(timeout) -> reap completed requests

A request's callback gets `None` on success or the error text. Closing cancels whatever is
still in flight and waits (bounded) for every callback, so each buffer's owner hears back.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx  # noqa: E402  (after the environment default above)
from ucxx._lib.arr import Array  # noqa: E402

Done = Callable[[str | None], None]
CLOSE_DRAIN_S = 5.0

# Tags: the top 2 bits say what a message is; receives match on them with KIND_MASK.
KIND_MASK = 3 << 62
HDR_TAG = 1 << 62  # sender id + a DATA or CANCEL frame, sender -> receiver
ACK_TAG = 2 << 62  # an ACK frame, receiver -> sender
DATA_KIND = 3 << 62  # one chunk payload


def data_tag(transfer_id: int, chunk_index: int) -> int:
    """Payload tag of one chunk: unique per (transfer, chunk) with overwhelming probability."""
    mixed = (transfer_id ^ (chunk_index * 0x9E3779B97F4A7C15)) & ((1 << 62) - 1)
    return DATA_KIND | mixed


class UcxLoop:
    def __init__(self, name: str, timeout_ms: int):
        self._timeout_ms = timeout_ms
        self.context = ucx.UCXContext(
            feature_flags=(ucx.Feature.TAG, ucx.Feature.STREAM, ucx.Feature.WAKEUP)
        )
        self.worker = ucx.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._calls: deque[Callable[[], None]] = deque()
        self._pending: list[tuple[Any, Done, Any]] = []  # (request, callback, kept alive)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"{name}-ucx-io", daemon=True)
        self.on_error: Callable[[BaseException], None] | None = None

    def start(self) -> None:
        self.thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the I/O thread (within one progress timeout)."""
        self._calls.append(fn)

    def track(self, request: Any, done: Done, keep: Any = None) -> None:
        """Call `done` when `request` completes; `keep` stays referenced until then."""
        self._pending.append((request, done, keep))

    def send(self, ep: Any, data: Any, tag: int, done: Done) -> None:
        self.track(ep.tag_send(Array(data), ucx.UCXXTag(tag)), done, data)

    def recv(self, owner: Any, data: Any, tag: int, mask: int, done: Done) -> None:
        """Post a tag receive on the worker, or on an endpoint so closing it cancels this."""
        if isinstance(owner, ucx.UCXWorker):
            req = owner.tag_recv(Array(data), ucx.UCXXTag(tag), ucx.UCXXTagMask(mask))
        else:
            req = owner.tag_recv(Array(data), ucx.UCXXTag(tag))
        self.track(req, done, data)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._step(self._timeout_ms)
        self._drain()

    def _step(self, timeout_ms: int) -> None:
        while self._calls:
            fn = self._calls.popleft()
            self._guard(fn)
        self.worker.progress_worker_event(timeout_ms)
        self._reap()

    def _reap(self) -> None:
        if not self._pending:
            return
        still, done = [], []
        for item in self._pending:
            (done if item[0].completed else still).append(item)
        self._pending = still
        for request, callback, _keep in done:
            try:
                request.check_error()
                error = None
            except Exception as exc:  # ucxx raises its own error types per status
                error = f"{type(exc).__name__}: {exc}"
            self._guard(lambda cb=callback, e=error: cb(e))

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # a bug in a callback must not kill the I/O thread
            if self.on_error is not None:
                self.on_error(exc)

    def _drain(self) -> None:
        """Cancel what is in flight and fire every callback (bounded by CLOSE_DRAIN_S)."""
        while self._calls:
            self._guard(self._calls.popleft())
        if self._pending:
            self.worker.cancel_inflight_requests()
        deadline = time.monotonic() + CLOSE_DRAIN_S
        while self._pending and time.monotonic() < deadline:
            self.worker.progress_worker_event(1)
            self._reap()
        for _request, callback, _keep in self._pending:  # never completed: report anyway
            self._guard(lambda cb=callback: cb("ucx request abandoned at close"))
        self._pending = []

    def close(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()
