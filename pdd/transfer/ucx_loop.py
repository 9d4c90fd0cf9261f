"""The UCX I/O thread: the only thread that touches the ucxx worker, its endpoints and requests.

API threads hand it work with `call(fn)`; it runs those, drives UCX progress in blocking
mode (epoll with a short timeout: shared-memory transports do not signal the event fd, so
progress must also run periodically) and fires completion callbacks of posted requests.

    loop: run queued calls -> progress -> reap completed requests

Progress polls while a caller's buffer is in flight (or a checksum is out on the helper
thread) and blocks in epoll (timeout `ucx_progress_timeout_ms`) when only our own header/ack
receives are posted. While polling it yields the GIL every pass: otherwise the helper thread
waits for it to hand a checksum back, which measured 3.4 against 6.4 GiB/s on 64 MiB.

A request's callback gets `None` on success or the error text. Closing cancels whatever is
still in flight and waits (bounded) for every callback, so each buffer's owner hears back.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx  # noqa: E402  (after the environment default above)
from ucxx._lib.arr import Array  # noqa: E402

log = logging.getLogger(__name__)
Done = Callable[[str | None], None]
CLOSE_DRAIN_S = 5.0
TICK_S = 0.05
POLL_NAP_S = 20e-6

# Tags: the top 2 bits say what a message is; receives match on them with KIND_MASK.
KIND_MASK = 3 << 62
HDR_TAG = 1 << 62  # sender id + a DATA or CANCEL frame, sender -> receiver
ACK_TAG = 2 << 62  # an ACK frame, receiver -> sender
DATA_KIND = 3 << 62  # one chunk payload


def data_tag(transfer_id: int, chunk_index: int) -> int:
    """Payload tag of one chunk: unique per (transfer, chunk) with overwhelming probability."""
    mixed = (transfer_id ^ (chunk_index * 0x9E3779B97F4A7C15)) & ((1 << 62) - 1)
    return DATA_KIND | mixed


def process_identity(shared_memory: bool) -> tuple[int, int]:
    """(pid, pid-namespace inode) a sender announces; (0, 0) when it uses no shared memory."""
    if not shared_memory:
        return 0, 0
    return os.getpid(), _own_pidns()


@functools.cache
def _own_pidns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def process_alive(pid: int, pidns: int) -> bool:
    """Is an announced peer process still running? Unknown (0, other namespace) is alive.

    Needed because UCX crashes when a receive matches a shared-memory rendezvous from a
    process that is already dead; a zombie counts as dead.
    """
    if not pid or pidns != _own_pidns():
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def close_endpoint(ep: Any) -> None:
    """Close an endpoint and drop its close callback (which would keep a reference cycle
    through our closures alive). Plain close() hangs on endpoints that already failed."""
    for step in (ep.remove_close_callback, lambda: ep.close_blocking(10_000, 100)):
        try:
            step()
        except Exception as exc:  # ucxx raises its own types for already closed endpoints
            log.debug("endpoint close: %s", exc)


class UcxLoop:
    def __init__(self, name: str, timeout_ms: int):
        self._timeout_ms = timeout_ms
        self.context = ucx.UCXContext(
            feature_flags=(ucx.Feature.TAG, ucx.Feature.STREAM, ucx.Feature.WAKEUP)
        )
        self.worker = ucx.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._calls: deque[Callable[[], None]] = deque()
        # (request, callback, kept alive, owner): owner names the peer a request belongs to
        self._pending: list[tuple[Any, Done, Any, Any]] = []
        self._abandoned: list[Any] = []  # requests of dead peers, kept so UCX never frees them
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"{name}-ucx-io", daemon=True)
        # A helper thread verifies checksums so progress (the next chunk's copy) goes on
        # meanwhile; the checksum releases the GIL, so the two use both cores.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs_out = 0  # offloaded and not yet handed back (I/O thread only)
        self._helper_done = False
        self.helper = threading.Thread(target=self._help, name=f"{name}-ucx-hash", daemon=True)
        self.on_error: Callable[[BaseException], None] | None = None
        self.on_tick: Callable[[], None] | None = None  # every TICK_S: liveness checks
        self.tainted = False  # a peer died on this worker: see release()
        self._next_tick = 0.0

    def start(self) -> None:
        self.thread.start()
        self.helper.start()

    def offload(self, fn: Callable[[], Any], then: Callable[[Any], None]) -> None:
        """Run `fn` on the helper thread, then `then(result)` back on the I/O thread."""
        if self._helper_done:  # closing: run inline
            then(fn())
            return
        self._jobs_out += 1

        def back(result: Any) -> None:
            self._jobs_out -= 1
            then(result)

        self._jobs.put((fn, back))

    def _help(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, then = job
            result = fn()
            self.call(lambda then=then, result=result: then(result))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the I/O thread (within one progress timeout)."""
        self._calls.append(fn)

    def track(self, request: Any, done: Done, keep: Any = None, owner: Any = None) -> None:
        """Call `done` when `request` completes; `keep` stays referenced until then."""
        self._pending.append((request, done, keep, owner))

    def send(self, ep: Any, data: Any, tag: int, done: Done, owner: Any = None) -> None:
        self.track(ep.tag_send(Array(data), ucx.UCXXTag(tag)), done, data, owner)

    def recv(self, on: Any, data: Any, tag: int, mask: int, done: Done, owner: Any = None):
        """Post a tag receive on the worker, or on an endpoint so closing it cancels this."""
        if isinstance(on, ucx.UCXWorker):
            req = on.tag_recv(Array(data), ucx.UCXXTag(tag), ucx.UCXXTagMask(mask))
        else:
            req = on.tag_recv(Array(data), ucx.UCXXTag(tag))
        self.track(req, done, data, owner)

    def abandon(self, owner: Any, reason: str) -> None:
        """Fail every pending request of a dead peer now.

        Endpoints built from a worker address have no UCX error handling (that is what
        allows shared memory), so a send to a dead peer never completes, even after its
        endpoint is closed. The dead peer can no longer read or write our buffers, so the
        owner gets its buffers back; the request objects are kept until close.
        """
        self.tainted = True
        mine = [item for item in self._pending if item[3] == owner]
        if not mine:
            return
        self._pending = [item for item in self._pending if item[3] != owner]
        for request, callback, _keep, _owner in mine:
            self._abandoned.append(request)
            self._guard(lambda cb=callback: cb(reason))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._step(self._timeout_ms)
        self._drain()

    def _step(self, timeout_ms: int) -> None:
        while self._calls:
            fn = self._calls.popleft()
            self._guard(fn)
        if self._jobs_out or any(item[3] is not None for item in self._pending):
            # Moving a caller's bytes: poll (shared memory never wakes epoll), yielding the
            # CPU briefly when a pass completed nothing so a slow peer costs little.
            progressed = False
            while self.worker.progress_once():
                progressed = True
            if not self._reap() and not progressed:
                time.sleep(POLL_NAP_S)
            else:
                time.sleep(0)  # let the helper thread take the GIL for its hand-back
        else:
            self.worker.progress_worker_event(timeout_ms)
            self._reap()
        now = time.monotonic()
        if self.on_tick is not None and now >= self._next_tick:
            self._next_tick = now + TICK_S
            self._guard(self.on_tick)

    def _reap(self) -> int:
        """Fire callbacks of completed requests; returns how many completed."""
        if not self._pending:
            return 0
        still, done = [], []
        for item in self._pending:
            (done if item[0].completed else still).append(item)
        self._pending = still
        for request, callback, _keep, _owner in done:
            try:
                request.check_error()
                error = None
            except Exception as exc:  # ucxx raises its own error types per status
                error = f"{type(exc).__name__}: {exc}"
            self._guard(lambda cb=callback, e=error: cb(e))
        return len(done)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # a bug in a callback must not kill the I/O thread
            if self.on_error is not None:
                self.on_error(exc)

    def _drain(self) -> None:
        """Cancel what is in flight and fire every callback.

        Requests that hold a caller's buffer (they have an owner) get up to CLOSE_DRAIN_S
        to complete or cancel; our own posted header/ack receives are simply dropped, and
        so are requests abandoned for dead peers (their worker is kept, see release()).
        """
        self._jobs.put(None)
        self.helper.join()
        self._helper_done = True
        while self._calls:
            self._guard(self._calls.popleft())
        self.worker.cancel_inflight_requests()
        deadline = time.monotonic() + CLOSE_DRAIN_S
        while any(item[3] is not None for item in self._pending):
            if time.monotonic() > deadline:
                break
            self.worker.progress_worker_event(1)
            self._reap()
        for _request, callback, _keep, _owner in self._pending:  # never completed
            self._guard(lambda cb=callback: cb("ucx request abandoned at close"))

    def release(self) -> None:
        """After close and after the owner dropped its endpoints: free worker, context.

        A worker that had a peer die on it is never destroyed: ucp_worker_destroy crashes
        (segfault, measured with ucxx 0.52 / UCX 1.21) tearing down the shared-memory
        endpoint of a dead process. It stays referenced until the process exits; the OS
        reclaims it then. Workers that only saw clean closes are freed.
        """
        self._pending, self._abandoned, self._calls = [], [], deque()
        self.on_tick = self.on_error = None
        if self.tainted:
            for obj in (self.worker, self.context):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # deliberate, see above
        self.worker = None
        self.context = None

    def close(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()
        if self.helper.is_alive():  # never started, or the I/O thread died
            self._jobs.put(None)
            self.helper.join()
