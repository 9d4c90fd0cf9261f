"""The transfer interface every transport implements, and the typed values it speaks.

A sender hands a `SendRequest` (KV segments of host memory plus metadata) to `Transport.send`
and gets a `TransferHandle` back at once; the transport's own threads move the bytes. A
receiver is the same `Transport` object built with `ReceiverHooks`: for every chunk it asks
`hooks.allocate(header)` for a writable buffer of exactly `header.nbytes` bytes, lands the bytes
there, verifies the checksum, and reports each inbound transfer once, terminal, through
`hooks.on_received` and `Transport.poll_received()`.

State machine of one outbound transfer:

    PENDING --first chunk on the wire--> TRANSFERRING --all chunks acknowledged--> DONE
       |                                      |
       +------ cancel / deadline / peer death / integrity failure -----> CANCELLED | FAILED

Ownership: the transport holds a reference to every source buffer of a transfer (a "pin")
from `send` until the transfer is terminal. A terminal state is published only after no
transport thread touches the buffers any more, so the caller may reuse them as soon as it
sees DONE, FAILED or CANCELLED. On the receive side the same holds for allocated buffers:
after an inbound transfer is reported, the transport never writes into its buffers again; the
bytes of a FAILED or CANCELLED transfer must not be used. (One documented limit: UCX cannot
cancel a request toward a peer that died on a shared-memory endpoint; such requests are
abandoned, which is safe because the dead process can no longer touch our memory.)

Every method is thread-safe and non-blocking (except `wait` and `close`, which joins the
threads). Callbacks and the allocator run on transport threads and must return quickly.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdd.transfer.wire import ChunkHeader


class TransferState(enum.StrEnum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.CANCELLED)


@dataclass(frozen=True)
class PeerAddress:
    """How to reach a receiving transport.

    `host`/`port` reach its listener over the network; `ucx_address` is its UCX worker address
    and `host_id` the boot id of its machine: a UCX sender on the same machine (equal host_id)
    connects to the worker address and gets shared memory instead of TCP.
    """

    host: str
    port: int
    ucx_address: bytes = b""
    host_id: str = ""
    name: str = ""  # inproc transports register under a name
    probes: bool = False  # TCP: it drops PROBE frames (a sender may warm the link up, tcp_send)

    def key(self) -> str:
        return self.name or f"{self.host}:{self.port}"


@dataclass(frozen=True)
class KVSegment:
    """One contiguous source buffer: KV blocks [block_start, block_end) x layers [layer_start, layer_end).

    `data` is any buffer-protocol object (numpy array, memoryview, bytes); `dtype` and `shape`
    describe the logical tensor it holds and travel in every chunk header so the receiver can
    place it without a side channel.
    """

    data: Any
    block_start: int = 0
    block_end: int = 0
    layer_start: int = 0
    layer_end: int = 0
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    kv_head_start: int = 0  # KV heads [kv_head_start, kv_head_end) (0, 0: not said)
    kv_head_end: int = 0
    layout: str = ""  # paged layout of the bytes (pdd.kv_geometry.LAYOUT_*; "": not said)


@dataclass(frozen=True)
class SendRequest:
    """What to send: the segments of one request's KV, in the order they should land."""

    request_id: str
    segments: Sequence[KVSegment]
    deadline_s: float | None = None  # None: the transport's configured default
    codec: str | None = None  # pdd.transfer.codec name; None: the transport's default for the peer


@dataclass(frozen=True)
class TransferStatus:
    """A snapshot of one outbound transfer."""

    transfer_id: int
    request_id: str
    state: TransferState
    reason: str = ""
    bytes_total: int = 0
    bytes_acked: int = 0  # raw KV bytes the receiver confirmed
    wire_bytes: int = 0  # payload bytes put on the wire (encoded; raw transports: bytes_acked)


@dataclass(frozen=True)
class InboundResult:
    """One inbound transfer, reported once when terminal (DONE, FAILED or CANCELLED)."""

    transfer_id: int
    request_id: str
    state: TransferState
    reason: str = ""
    bytes_received: int = 0
    chunks: int = 0
    internal_error: bool = False  # failed by a bug on the receive side, not by the peer or link


@dataclass(frozen=True)
class LinkEstimate:
    """Live estimate of the path to one peer (goodput of acknowledged bytes, kernel RTT)."""

    bandwidth_bps: float  # bits per second; 0.0 until a busy period was measured
    rtt_s: float
    samples: int = 0


@dataclass(frozen=True)
class TransportStats:
    """What the transport holds right now; all zero after a clean test."""

    open_outbound: int
    pinned_buffers: int
    open_inbound: int
    lent_buffers: int
    threads: int
    internal_errors: int = 0  # receive-side bugs so far (each failed one transfer, loudly)


Allocator = Callable[[ChunkHeader], memoryview]


@dataclass
class ReceiverHooks:
    """How received bytes land: `allocate(header)` returns a writable buffer of header.nbytes.

    `allocate` runs on a transport thread and must not block for long; it may raise a
    PddError to refuse the chunk (no room, unknown request: the transfer then fails). Any other
    exception is a bug: it is logged with its traceback and fails the transfer as an internal
    error (``InboundResult.internal_error``, ``AckStatus.INTERNAL`` at the sender). `on_received` is called once per inbound transfer
    when it is terminal; it must return quickly (hand work to another thread).
    `on_verified(header)` (optional) is called once per chunk whose bytes are complete in the
    lent buffer and passed the checksum (and decoded), before the chunk is counted: so it
    always runs before that transfer's `on_received`. It runs on a transport thread, must
    return quickly and not raise (an exception is logged and ignored).
    """

    allocate: Allocator
    on_received: Callable[[InboundResult], None] | None = None
    on_verified: Callable[[ChunkHeader], None] | None = None


@dataclass
class FaultHooks:
    """Test hooks on the sender: `corrupt(header) -> bool` flips one payload byte on the wire;
    `shorten(header) -> bool` sends only the first half of an encoded (codec != none) payload,
    with a matching wire size and checksum: a truncated codec frame that passes the transport's
    integrity check, so only decoding can catch it."""

    corrupt: Callable[[ChunkHeader], bool] | None = None
    shorten: Callable[[ChunkHeader], bool] | None = None


class TransferHandle:
    """The caller's view of one outbound transfer; returned by `Transport.send` at once."""

    def __init__(self, transport: Transport, transfer_id: int, request_id: str):
        self.transport = transport
        self.transfer_id = transfer_id
        self.request_id = request_id

    def status(self) -> TransferStatus:
        return self.transport.poll(self.transfer_id)

    @property
    def state(self) -> TransferState:
        return self.status().state

    def cancel(self) -> None:
        self.transport.cancel(self.transfer_id)

    def defer(self) -> None:
        self.transport.defer(self.transfer_id)

    def wait(self, timeout_s: float) -> TransferStatus:
        """Block until terminal or timeout (tests and benchmarks; the connector polls)."""
        return self.transport.wait(self.transfer_id, timeout_s)


class Transport(ABC):
    """One process's endpoint of a transport kind: sends to peers, receives if given hooks."""

    kind: str = "abstract"

    @abstractmethod
    def start(self) -> None:
        """Start the I/O threads and the listener (if receiving). Idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Fail every open transfer, release every pin and lent buffer, join all threads."""

    @property
    @abstractmethod
    def address(self) -> PeerAddress:
        """Where peers reach this transport's receiver (valid after start)."""

    @abstractmethod
    def send(self, peer: PeerAddress, request: SendRequest) -> TransferHandle:
        """Pin the segments and queue them for `peer`; returns at once (never blocks on I/O)."""

    @abstractmethod
    def poll(self, transfer_id: int) -> TransferStatus:
        """Current status; raises TransferError for an unknown id (reported and forgotten)."""

    @abstractmethod
    def cancel(self, transfer_id: int) -> None:
        """Ask to stop; the state becomes CANCELLED once no thread touches the buffers."""

    @abstractmethod
    def defer(self, transfer_id: int) -> None:
        """Send the rest of this transfer only when no other transfer to its peer has a chunk
        waiting (it is still wanted, but nobody waits for it). A transport whose transfers do
        not share a link in turn (UCX, in-process) may send it as before."""

    @abstractmethod
    def wait(self, transfer_id: int, timeout_s: float) -> TransferStatus:
        """Block the calling thread until the transfer is terminal or the timeout passes."""

    @abstractmethod
    def poll_finished(self) -> list[TransferStatus]:
        """Drain outbound transfers that became terminal since the last call (then forgotten)."""

    @abstractmethod
    def poll_received(self) -> list[InboundResult]:
        """Drain inbound transfers reported since the last call."""

    @abstractmethod
    def link_estimate(self, peer: PeerAddress) -> LinkEstimate | None:
        """Live bandwidth/RTT toward `peer`, or None before any traffic."""

    def warm(self, peer: PeerAddress) -> bool:
        """Open the link to ``peer`` and measure it before a transfer needs it (TCP: module
        doc of pdd.transfer.tcp_send); returns at once, whether a warm-up started. A transport
        with nothing to ramp up (UCX, in-process) does nothing."""
        return False

    def warming(self, peer: PeerAddress) -> bool:
        """The warm-up ``warm`` started toward ``peer`` is still under way."""
        return False

    def wire_ratio(self, peer: PeerAddress | None = None) -> float:
        """Learned wire/raw byte ratio of what this transport sends to `peer` (1.0: raw)."""
        return 1.0

    def link_estimates(self) -> dict[str, LinkEstimate]:
        """Every peer's estimate keyed by `PeerAddress.key()`, for export (router, metrics)."""
        return {}

    def queued_bytes(self) -> dict[str, int]:
        """Bytes of open transfers not yet acknowledged, per `PeerAddress.key()` (deferred
        transfers not counted): what a new transfer to that peer may find ahead of it."""
        return {}

    @abstractmethod
    def stats(self) -> TransportStats:
        """Open transfers, pins, lent buffers and live threads (leak checks)."""
