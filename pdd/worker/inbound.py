"""Inbound KV bookkeeping shared by the receiving roles (relay_decode, main_decode).

``InboundState``: the transfers that carry one request's KV (keyed by the transport header's
request id, the router's ``kv_request_id``), as the receiver sees them: seen on their first
chunk (``allocate``), ended when the transport reports them. It is *terminal* once every part
ended (or one of them failed: P sends no more after it) and none is open, or the request was
cancelled; its ``outcome`` is what AwaitKv
answers. Mutated on transport threads under the owning role's lock.

``Waiters``: AwaitKv / Generate(kv_in) wait for a request's state to change; transport threads
wake them with ``notify_threadsafe``.

``Recent``: the outcome of requests whose records were released, so a late AwaitKv still gets
the real answer and late chunks of a released request are refused (bounded).

``wire_id`` / ``split_wire_id`` / ``parts_of``: a chunk's request id is ``kv_id#landing_key``
when the receiver keyed its reservation (PrepareKvResponse.landing_key, handed by the router to
the one P it chose). A P that streams its blocks while it prefills sends them in *parts*, one
transfer each, one after the other: every part but the last says more follow (``+``), the last
says how many there were (``~N``); a whole send is one part and says nothing.

``whole_slot``: the one check of an inbound chunk's segment shape (both receivers land one
whole block per segment; the place to widen for partial or converted landing).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.errors import TransferError
from pdd.transfer import ChunkHeader, InboundResult, TransferState
from pdd.worker.roles import AwaitKvResult

RECENT = 4096


MORE, LAST = "+", "~"  # part marks after the landing key (never in a key: base64url)


def wire_id(kv_id: str, landing_key: str, parts: int | None = 1) -> str:
    """The request id P's chunks carry. ``parts``: 1, a whole send; None, a part more follow;
    N > 1, the last of N parts."""
    if parts == 1:
        return f"{kv_id}#{landing_key}" if landing_key else kv_id
    return f"{kv_id}#{landing_key}{MORE if parts is None else f'{LAST}{parts}'}"


def split_wire_id(request_id: str) -> tuple[str, str]:
    """(kv_id, landing key) of a chunk's request id (key "" without one)."""
    kv_id, _, rest = request_id.partition("#")
    return kv_id, rest.partition(MORE)[0].partition(LAST)[0]


def parts_of(request_id: str) -> int | None:
    """How many transfers carry the request's KV in all, as a chunk's request id says: 1 for a
    whole send, N on the last of N parts, None on an earlier part."""
    rest = request_id.partition("#")[2]
    if rest.endswith(MORE):
        return None
    _, mark, n = rest.partition(LAST)
    return int(n) if mark and n.isdigit() else 1


def new_landing_key() -> str:
    """A reservation's landing key: 72 random bits, 12 characters."""
    return secrets.token_urlsafe(9)


def key_matches(expected: str, got: str) -> bool:
    """Whether a chunk's landing key is its reservation's ("" expected: any sender)."""
    return not expected or hmac.compare_digest(expected.encode(), got.encode())


@dataclass
class InboundState:
    open: set[int] = field(default_factory=set)  # transfer ids seen, not yet reported
    ended: dict[int, InboundResult] = field(default_factory=dict)
    bytes_received: int = 0
    cancelled: str | None = None  # why the receiver gave the request up
    parts: int | None = None  # transfers in all, once a whole send or a last part said

    def seen(self, transfer_id: int, request_id: str) -> None:
        """A chunk of ``transfer_id`` arrived (its part mark is read once, on the first)."""
        if transfer_id in self.open or transfer_id in self.ended:
            return
        self._part(request_id)
        self.open.add(transfer_id)

    def finish(self, result: InboundResult) -> None:
        self._part(result.request_id)
        self.open.discard(result.transfer_id)
        self.ended[result.transfer_id] = result
        self.bytes_received += result.bytes_received

    def _part(self, request_id: str) -> None:
        n = parts_of(request_id)
        if n is not None:
            self.parts = n

    @property
    def never_seen(self) -> bool:
        """No transfer of it arrived yet (and it was not given up)."""
        return self.cancelled is None and not self.open and not self.ended

    @property
    def terminal(self) -> bool:
        if self.cancelled is not None:
            return True
        if not self.ended or self.open:
            return False
        every_part = self.parts is not None and len(self.ended) >= self.parts
        return every_part or any(r.state is not TransferState.DONE for r in self.ended.values())

    @property
    def done(self) -> bool:
        """Every part landed (and the request was not given up before)."""
        return (
            self.terminal
            and self.cancelled is None
            and all(r.state is TransferState.DONE for r in self.ended.values())
        )

    def outcome(self) -> tuple[str, str]:
        """(state, reason) for AwaitKv: done | failed | cancelled | pending."""
        if self.done:
            return "done", ""
        if self.cancelled is not None:
            return "cancelled", self.cancelled
        if not self.terminal:
            return "pending", ""
        bad = next(r for r in self.ended.values() if r.state is not TransferState.DONE)
        return bad.state.value, bad.reason


class Waiters:
    """Futures waiting for a key to change; woken from any thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def wait_until(self, key: str, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``ready()`` (re-checked on every notify of ``key``) or the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.0)
        while not ready():
            left = deadline - loop.time()
            if left <= 0:
                return False
            fut: asyncio.Future[None] = loop.create_future()
            self._waiting.setdefault(key, set()).add(fut)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(fut, left)
            finally:
                waiters = self._waiting.get(key)
                if waiters is not None:
                    waiters.discard(fut)
                    if not waiters:
                        del self._waiting[key]
        return True

    def notify(self, key: str) -> None:
        """Wake the waiters of ``key`` (on the loop)."""
        for fut in self._waiting.get(key, ()):
            if not fut.done():
                fut.set_result(None)

    def notify_threadsafe(self, key: str, then: Callable[[], None] | None = None) -> None:
        """From a transport thread: run ``then`` and wake the waiters, on the loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def run() -> None:
            if then is not None:
                then()
            self.notify(key)

        with contextlib.suppress(RuntimeError):  # the loop is shutting down
            loop.call_soon_threadsafe(run)


@dataclass(frozen=True)
class Outcome:
    state: str
    reason: str
    bytes_received: int
    blocks: int
    at: float


class Recent:
    """Outcomes of released requests (bounded, oldest dropped first)."""

    def __init__(self, size: int = RECENT) -> None:
        self._size = size
        self._items: OrderedDict[str, Outcome] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> Outcome | None:
        return self._items.get(key)

    def forget(self, key: str) -> None:
        self._items.pop(key, None)

    def response(self, key: str) -> AwaitKvResult:
        """AwaitKv's answer for a request with no live record: its remembered outcome, or
        unknown."""
        past = self._items.get(key)
        if past is None:
            return await_response("unknown", 0, 0, "no KV expected or received for it")
        return await_response(past.state, past.bytes_received, past.blocks, past.reason)

    def put(self, key: str, state: InboundState, blocks: int) -> None:
        st, reason = state.outcome()
        if st == "pending":
            st, reason = "cancelled", "released before its KV arrived"
        self._items[key] = Outcome(st, reason, state.bytes_received, blocks, time.monotonic())
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)


def await_response(state: str, bytes_received: int, blocks: int, reason: str) -> AwaitKvResult:
    """AwaitKv's answer; a state still pending when the wait ended is a timeout."""
    if state == "pending":
        state = "timeout"
    return AwaitKvResult(state, bytes_received, blocks, reason)


def whole_slot(header: ChunkHeader, slot_bytes: int) -> None:
    """Refuse (TransferError: the chunk and its transfer) a segment that is not exactly one
    block of ``slot_bytes`` bytes."""
    if header.segment_nbytes != slot_bytes or header.block_end != header.block_start + 1:
        raise TransferError(
            f"KV of {header.request_id!r}: a segment must be one block of {slot_bytes} bytes, "
            f"got blocks [{header.block_start}, {header.block_end}) of "
            f"{header.segment_nbytes} bytes"
        )
