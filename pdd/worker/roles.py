"""What a role policy plugs into the worker shell, and the values they exchange.

The shell (``service.WorkerService``) owns admission, gRPC and metrics; a *role policy*
(pdd.prefill, pdd.relay_decode, pdd.main_decode, or ``PlainRole`` for colocated workers)
decides what a Generate does with KV and serves the KV RPCs it ``supports``. The shell asks a
role only for what it declared: an RPC it does not support is answered UNIMPLEMENTED, a
Generate with ``kv_stage`` / ``kv_in`` it cannot honour FAILED_PRECONDITION.

The optional capabilities are typed protocols, one per job: ``SendsKv`` (P: SendKv),
``ReceivesKv`` (RLD, MD: PrepareKv, AwaitKv), ``CancelsKv`` (every KV role: CancelKv),
``PublishesDrc`` (MD: DrcEvents). A role that lists an RPC in ``supports`` implements its
method; the shell calls that method by its typed name (never looked up from the RPC's name).
The composition root that picks a role is ``pdd.launch.worker``, above the roles.

Every value a role takes or returns is a frozen pdd dataclass of this module (one call and one
result per KV RPC, field for field the wire's message), never a protobuf message: the wire is
the shell's business, converted both ways in ``pdd.worker.convert`` alone, so a role reads as
plain Python and never imports pdd.proto (import-linter contract ``roles-off-the-wire``).

Roles are composed from shell mechanisms (``KvPlane``, ``SlotPool``, ``run_with_kv``); they
never import each other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdd.cache.messages import DrcEventBatch, DrcSnapshot, DrcStats
from pdd.config import PddConfig, WorkerConfig
from pdd.engine.types import EngineDelta, SamplingSpec
from pdd.transfer import PeerAddress

if TYPE_CHECKING:
    from pdd.engine.engine import Engine
    from pdd.worker.kv_plane import KvPlane

# Names a role may list in ``supports``.
KV_STAGE = "kv_stage"  # Generate(kv_stage=true)
KV_IN = "kv_in"  # Generate(kv_in=TRANSFER|DRC)
SESSIONS = "sessions"  # Generate(session=...) held open across calls; Abort(id) ends one
KV_RPCS = ("SendKv", "PrepareKv", "AwaitKv", "CancelKv", "DrcEvents")


@dataclass(frozen=True)
class KvInSpec:
    """Where a Generate's prompt KV comes from (proto KvIn)."""

    source: str  # "transfer" | "drc"
    kv_request_id: str
    wait_s: float


@dataclass(frozen=True)
class SessionSpec:
    """A request that continues across Generate calls (proto Session): with ``keep`` the
    worker holds it open after this call."""

    id: str
    keep: bool


@dataclass(frozen=True)
class GenerateCall:
    """One admitted Generate: validated input, ready for the role."""

    request_id: str
    prompt: list[int]
    sampling: SamplingSpec
    kv_stage: bool = False
    kv_in: KvInSpec | None = None
    cache_salt: str = ""  # the prefix-cache namespace (tenant); "": the shared one
    session: SessionSpec | None = None  # MD's Catch-Up: held open across calls


@dataclass(frozen=True)
class KvDelta:
    """An engine delta plus what the role adds to the response.

    ``staged_blocks``: P, last response: prompt blocks staged for SendKv.
    ``loaded_tokens``: RLD/MD: prompt tokens whose KV came from outside the engine (slots
    offered on the first response; confirmed by the connector on the last one).
    """

    delta: EngineDelta
    staged_blocks: int = 0
    loaded_tokens: int = 0


@dataclass(frozen=True)
class KvStats:
    """The KV plane of one worker right now (all zero for a colocated worker)."""

    pinned_slots: int = 0
    open_transfers: int = 0
    drc: DrcStats | None = None
    drc_query_tokens: int = 0
    drc_hit_tokens: int = 0
    wan_bandwidth_bps: float = 0.0
    wan_rtt_s: float = 0.0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_wire_bytes_sent: int = 0  # P: what crossed after the WAN codec
    wan_wire_ratio: float = 0.0  # P: learned wire/raw ratio of its WAN codec (0: unknown)
    kv_refused_chunks: int = 0  # inbound chunks refused: other geometry (kv_wire) or landing key
    kv_in_waits: int = 0  # MD: Generate calls that waited for KV still on its way
    own_blocks_stored: int = 0  # MD: blocks the engine copied into the DRC after requests
    md_sessions: int = 0  # MD: Catch-Up sessions open (between calls or in one)
    md_session_turns: int = 0  # MD: Generate calls that continued an open session
    arena_blocks: int = 0  # P: staging slots, RLD: landing slots, MD: DRC blocks (0: none)
    free_blocks: int = 0  # of those, what a new request can have now (MD: evictable counts)
    address: KvAddress | None = None  # RLD/MD: where it receives KV (None: it receives none)
    wan_links: tuple[WanLinkStats, ...] = ()  # P: each TCP link it sends KV on


@dataclass(frozen=True)
class WanLinkStats:
    """P's link to one receiver (wire: WanLink)."""

    peer: str  # the receiver's worker id
    bandwidth_bps: float  # 0.0 until measured
    rtt_s: float
    queued_bytes: int  # open transfers' bytes not yet acknowledged (deferred ones not)


# --- the KV RPCs' values (wire: pdd.worker.v1 messages of the same names) -----------------


@dataclass(frozen=True)
class KvAddress:
    """Where a worker receives KV (wire: PeerAddress); ``transport`` "" when it receives none."""

    transport: str = ""  # "ucx" | "tcp" | "inproc"
    host: str = ""
    port: int = 0
    ucx_address: bytes = b""  # UCX worker address (same-host shared memory)
    host_id: str = ""  # boot id of its machine
    name: str = ""  # inproc transports register under a name
    probes: bool = False  # TCP: it drops PROBE frames (a sender may warm its link up)

    def peer(self) -> PeerAddress:
        """The transport's view of it (what ``Transport.send`` dials)."""
        return PeerAddress(self.host, self.port, self.ucx_address, self.host_id, self.name,
                           self.probes)  # fmt: skip


@dataclass(frozen=True)
class KvDestination:
    """One place P sends a request's staged blocks ``[first_block, staged)`` to."""

    peer: KvAddress
    first_block: int = 0
    landing_key: str = ""  # the destination's PrepareKvResult.landing_key, if it gave one
    tail: bool = False  # also the prompt's last block cut short (KvDestination.tail, proto)


@dataclass(frozen=True)
class SendKvCall:
    kv_request_id: str
    destinations: tuple[KvDestination, ...] = ()
    deadline_s: float = 0.0  # 0: the transport's default


@dataclass(frozen=True)
class SendKvResult:
    staged_blocks: int
    bytes_per_destination: tuple[int, ...]  # raw KV bytes queued, per destination
    wire_bytes_per_destination: tuple[int, ...]  # expected on the wire (learned codec ratio)


@dataclass(frozen=True)
class PrepareKvCall:
    kv_request_id: str
    prompt: tuple[int, ...] = ()
    lease_s: float = 0.0  # 0: workers[].kv_landing_lease_s
    cache_salt: str = ""  # the prefix-cache namespace the DRC is looked up under


@dataclass(frozen=True)
class PrepareKvResult:
    cached_blocks: int  # blocks already held here (not to be sent)
    reserved_blocks: int  # landing slots reserved for the rest of the blocks (RLD: the tail's too)
    address: KvAddress  # where to send them
    landing_key: str = ""  # chunks must carry "kv_request_id#landing_key" ("": any sender)


@dataclass(frozen=True)
class AwaitKvCall:
    kv_request_id: str
    timeout_s: float = 0.0


@dataclass(frozen=True)
class AwaitKvResult:
    state: str  # "done" | "failed" | "cancelled" | "timeout" | "unknown"
    bytes_received: int = 0
    blocks_ready: int = 0
    reason: str = ""


@dataclass(frozen=True)
class CancelKvCall:
    kv_request_id: str
    reason: str = ""
    background: bool = False  # only the request's claim goes: the KV still lands (proto)


@dataclass(frozen=True)
class CancelKvResult:
    found: bool


@dataclass(frozen=True)
class DrcEventsCall:
    since: int  # < 0: a snapshot; else the events after this sequence number


@dataclass(frozen=True)
class DrcEventsResult:
    feed: DrcSnapshot | DrcEventBatch  # a snapshot resyncs the router's replica


@dataclass(frozen=True)
class WarmKvCall:
    peers: tuple[KvAddress, ...]  # receivers this worker will send KV to


@dataclass(frozen=True)
class WarmKvResult:
    warming: int  # links whose warm-up this call started (the others were measured already)


@dataclass(frozen=True)
class RoleContext:
    """Everything a role is built from (the composition root fills it)."""

    engine: Engine
    plane: KvPlane | None
    worker: WorkerConfig
    config: PddConfig
    block_size: int
    block_bytes: int


class RolePolicy(Protocol):
    """The shell's view of a role. For each KV RPC named in ``supports`` the role implements
    the matching capability below (taking and returning this module's values; raising
    PddError)."""

    name: str
    supports: frozenset[str]

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def generate(self, call: GenerateCall) -> AsyncIterator[KvDelta]: ...
    def kv_stats(self) -> KvStats: ...


class SendsKv(Protocol):
    """Sends staged KV to its destinations (P: SendKv)."""

    async def send_kv(self, call: SendKvCall) -> SendKvResult: ...


class ReceivesKv(Protocol):
    """Reserves landing slots for a request's KV and says when it landed (RLD, MD)."""

    async def prepare_kv(self, call: PrepareKvCall) -> PrepareKvResult: ...
    async def await_kv(self, call: AwaitKvCall) -> AwaitKvResult: ...


class CancelsKv(Protocol):
    """Drops whatever KV it holds or expects for a request (every KV role: CancelKv)."""

    async def cancel_kv(self, call: CancelKvCall) -> CancelKvResult: ...


class WarmsLinks(Protocol):
    """Opens and measures its links to receivers before a request needs them (P: WarmKv)."""

    async def warm_kv(self, call: WarmKvCall) -> WarmKvResult: ...


class KeepsSessions(Protocol):
    """Holds requests open across Generate calls (MD: GenerateRequest.session)."""

    def end_session(self, session_id: str) -> bool: ...


class PublishesDrc(Protocol):
    """Publishes its DRC's events for the router's replica (MD: DrcEvents)."""

    async def drc_events(self, call: DrcEventsCall) -> DrcEventsResult: ...


class PlainRole:
    """Colocated worker: Generate only, no KV plane."""

    name = "colocated"
    supports: frozenset[str] = frozenset()

    def __init__(self, ctx: RoleContext) -> None:
        self._engine = ctx.engine

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def generate(self, call: GenerateCall) -> AsyncIterator[KvDelta]:
        stream = self._engine.generate(
            call.request_id, call.prompt, call.sampling, cache_salt=call.cache_salt
        )
        async with aclosing(stream):  # closing it early aborts the engine request
            async for delta in stream:
                yield KvDelta(delta)

    def kv_stats(self) -> KvStats:
        return KvStats()
