"""The KV plane of the fake workers: PrepareKv, SendKv, AwaitKv, CancelKv, DrcEvents.

One ``FakeKvPlane`` per harness links the fakes (P sends to a destination by the name in its
PeerAddress) and remembers each request's original prompt, so a fake RLD/MD can check that
what it is asked to continue is exactly ``prompt + the tokens emitted so far``.

Ownership mirrors the design note, so tests can assert that nothing is left held:
  P     staged blocks from its kv_stage Generate until every send ended, or CancelKv
  RLD   a PrepareKv lease until its Generate loaded the blocks (or ended), or CancelKv
  MD    a PrepareKv lease (landing slots, then DRC pins) until a Generate with kv_in=DRC
        ended, or CancelKv, or (CancelKv(background)) the landing ended. Landed blocks are committed to its DRC set (BlockStored events).
Landing takes ``land_delay_s`` (scripted per destination). Everything runs on the harness's
event loop; tests only read the state (``held()``) and set attributes between requests.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from pdd.cache.hashing import BlockHash, block_hashes, model_salt
from pdd.cache.messages import BlockRemoved, BlockStored, DrcEvent, DrcEventBatch, DrcSnapshot
from pdd.config import ModelConfig
from pdd.proto import worker_pb2

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 4
BLOCK_BYTES = 1000
SALT = model_salt(MODEL, ModelConfig().dtype, BLOCK_SIZE)  # the router's default config


def prompt_hashes(prompt: list[int] | tuple[int, ...]) -> list[BlockHash]:
    return block_hashes(list(prompt), BLOCK_SIZE, SALT)


@dataclass
class Lease:
    """A destination's hold for one request: reserved -> landing -> done | cancelled."""

    hashes: list[BlockHash]
    cached: int
    state: str = "reserved"
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    kept: bool = False  # CancelKv(background): released when it lands, no Generate comes


class FakeKvPlane:
    def __init__(self) -> None:
        self.nodes: dict[str, FakeKvNode] = {}
        self.prompts: dict[str, tuple[int, ...]] = {}

    def reset(self) -> None:
        self.prompts.clear()
        for node in self.nodes.values():
            node.reset()

    def held(self) -> dict[str, set[str]]:
        """Per worker, the request ids it still holds KV for (empty when all is released)."""
        return {wid: node.held() for wid, node in self.nodes.items() if node.held()}


class FakeKvNode:
    """One worker's KV-plane state and RPC behaviour."""

    def __init__(self, plane: FakeKvPlane, worker_id: str, role: str):
        self.plane = plane
        self.worker_id = worker_id
        self.role = role
        plane.nodes[worker_id] = self
        self.drc: dict[BlockHash, None] = {}  # insertion order: parents before children
        self.epoch = uuid.uuid4().hex
        self.events: list[DrcEvent] = []
        self.reset()

    def reset(self) -> None:
        self.clear_drc()
        self.land_delay_s = 0.0
        self.fail_landing = False  # the transfer breaks: AwaitKv answers "failed"
        self.staged: dict[str, int] = {}
        self.outbound: dict[str, set[str]] = {}
        self.closed: set[str] = set()  # cancelled before they were staged
        self.leases: dict[str, Lease] = {}
        self.final_states: dict[str, str] = {}
        self.prepares: list[str] = []
        self.sends: list[tuple[str, list[tuple[str, int]]]] = []
        self.cancels: list[tuple[str, str]] = []
        self.deferred: list[str] = []  # CancelKv(background) calls
        self.awaits: list[str] = []
        self.waits: list[str] = []  # Generates that found their KV still on its way

    def held(self) -> set[str]:
        return set(self.staged) | set(self.outbound) | set(self.leases)

    # --- DRC (MD) ---------------------------------------------------------------------------

    def preload(self, prompt: list[int]) -> int:
        """Put a prompt's whole blocks into the DRC (as an earlier turn would); returns them."""
        return self._commit(prompt_hashes(prompt))

    def clear_drc(self) -> None:
        """Evict everything (one BlockRemoved event, children first)."""
        if self.drc:
            gone = tuple(reversed(self.drc))
            self.drc.clear()
            self.events.append(BlockRemoved(seq=len(self.events) + 1, block_hashes=gone))

    def _commit(self, hashes: list[BlockHash]) -> int:
        new = [h for h in hashes if h not in self.drc]
        if new:
            self.drc.update(dict.fromkeys(new))
            parent = hashes[hashes.index(new[0]) - 1] if hashes.index(new[0]) > 0 else None
            seq = len(self.events) + 1
            self.events.append(BlockStored(seq=seq, parent_hash=parent, block_hashes=tuple(new)))
        return len(new)

    def drc_events(self, since: int) -> worker_pb2.DrcEventsResponse:
        seq = len(self.events)
        if since < 0:
            snap = DrcSnapshot(
                epoch=self.epoch, seq=seq, block_size=BLOCK_SIZE, block_hashes=tuple(self.drc)
            )
            return worker_pb2.DrcEventsResponse(json=snap.model_dump_json(), snapshot=True)
        batch = DrcEventBatch(
            epoch=self.epoch, block_size=BLOCK_SIZE, last_seq=seq,
            events=tuple(e for e in self.events if e.seq > since),
        )  # fmt: skip
        return worker_pb2.DrcEventsResponse(json=batch.model_dump_json(), snapshot=False)

    # --- receivers (RLD, MD, D) -------------------------------------------------------------

    def prepare(self, kv_id: str, prompt: list[int]) -> worker_pb2.PrepareKvResponse:
        self.prepares.append(kv_id)
        self.plane.prompts.setdefault(kv_id, tuple(prompt))
        hashes = prompt_hashes(prompt)
        cached = 0
        if self.role == "main_decode":
            while cached < len(hashes) and hashes[cached] in self.drc:
                cached += 1
        lease = self.leases[kv_id] = Lease(hashes, cached)
        if cached == len(hashes):  # nothing to land
            lease.state = "done"
            lease.landed.set()
        return worker_pb2.PrepareKvResponse(
            cached_blocks=cached, reserved_blocks=len(hashes) - cached, address=self.address()
        )

    def address(self) -> worker_pb2.PeerAddress | None:
        """Where this node receives KV (RLD, MD; None: it receives none)."""
        if self.role not in ("main_decode", "relay_decode"):
            return None
        transport = "tcp" if self.role == "main_decode" else "ucx"
        return worker_pb2.PeerAddress(transport=transport, name=self.worker_id)

    def start_landing(self, kv_id: str, source: FakeKvNode) -> bool:
        lease = self.leases.get(kv_id)
        if lease is None or lease.state != "reserved":
            return False
        lease.state = "landing"
        lease.task = asyncio.get_running_loop().create_task(self._land(kv_id, lease, source))
        return True

    async def _land(self, kv_id: str, lease: Lease, source: FakeKvNode) -> None:
        try:
            await asyncio.sleep(self.land_delay_s)
        except asyncio.CancelledError:
            source.send_ended(kv_id, self.worker_id)
            raise
        lease.state = "failed" if self.fail_landing else "done"
        if self.role == "main_decode" and lease.state == "done":
            self._commit(lease.hashes)
        lease.landed.set()
        source.send_ended(kv_id, self.worker_id)
        if lease.kept:
            self.release(kv_id, lease.state)

    async def await_kv(self, kv_id: str, timeout: float) -> worker_pb2.AwaitKvResponse:
        self.awaits.append(kv_id)
        lease = self.leases.get(kv_id)
        if lease is None:
            return worker_pb2.AwaitKvResponse(state=self.final_states.get(kv_id, "unknown"))
        try:
            await asyncio.wait_for(lease.landed.wait(), timeout)
        except TimeoutError:
            return worker_pb2.AwaitKvResponse(state="timeout")
        n = len(lease.hashes) - lease.cached
        return worker_pb2.AwaitKvResponse(
            state=lease.state, bytes_received=n * BLOCK_BYTES, blocks_ready=len(lease.hashes)
        )

    async def load(self, kv_id: str, wait_s: float) -> int:
        """A Generate with kv_in: wait (bounded) for the landing; returns blocks loaded."""
        lease = self.leases.get(kv_id)
        if lease is None:
            return 0
        if lease.state in ("reserved", "landing"):
            self.waits.append(kv_id)
            try:
                await asyncio.wait_for(lease.landed.wait(), wait_s)
            except TimeoutError:
                return 0
        return len(lease.hashes) if lease.state == "done" else 0

    def abort_landing(self, kv_id: str) -> None:
        """The sender cut the transfer: the lease stays (the router releases it)."""
        lease = self.leases.get(kv_id)
        if lease is not None and lease.state != "done":
            if lease.task is not None:
                lease.task.cancel()
            lease.state = "cancelled"
            lease.landed.set()

    def release(self, kv_id: str, state: str) -> bool:
        lease = self.leases.pop(kv_id, None)
        if lease is None:
            return False
        if lease.task is not None and not lease.task.done():
            lease.task.cancel()
        lease.state = lease.state if lease.state == "done" else state
        self.final_states[kv_id] = lease.state
        lease.landed.set()
        return True

    # --- P ----------------------------------------------------------------------------------

    def stage(self, kv_id: str, prompt: list[int]) -> int:
        self.plane.prompts.setdefault(kv_id, tuple(prompt))
        if kv_id in self.closed:  # cancelled while it prefilled (a streamed send's release)
            self.closed.discard(kv_id)
            return 0
        self.staged[kv_id] = len(prompt) // BLOCK_SIZE
        return self.staged[kv_id]

    def send(self, kv_id: str, dests: list[worker_pb2.KvDestination]) -> list[int] | None:
        staged = self.staged.get(kv_id)
        if staged is None:
            return None
        self.sends.append((kv_id, [(d.peer.name, d.first_block) for d in dests]))
        out = []
        self.outbound[kv_id] = set()
        for d in dests:
            node = self.plane.nodes[d.peer.name]
            self.outbound[kv_id].add(node.worker_id)
            if not node.start_landing(kv_id, self):
                self.outbound[kv_id].discard(node.worker_id)
            out.append((staged - d.first_block) * BLOCK_BYTES)
        self._maybe_unstage(kv_id)
        return out

    def send_ended(self, kv_id: str, dest: str) -> None:
        self.outbound.get(kv_id, set()).discard(dest)
        self._maybe_unstage(kv_id)

    def _maybe_unstage(self, kv_id: str) -> None:
        if kv_id in self.outbound and not self.outbound[kv_id]:
            del self.outbound[kv_id]
            self.staged.pop(kv_id, None)

    def cancel(self, kv_id: str, reason: str, background: bool = False) -> bool:
        if background:  # P: its sends go on; MD: the landing goes on, released when it ends
            self.deferred.append(kv_id)
            lease = self.leases.get(kv_id)
            if lease is not None:
                lease.kept = True
                if lease.state not in ("reserved", "landing"):
                    self.release(kv_id, lease.state)
            return kv_id in self.staged or lease is not None
        self.cancels.append((kv_id, reason))
        found = kv_id in self.staged or kv_id in self.outbound
        if not found:  # P: a request still prefilling stages nothing (as a real P's stage)
            self.closed.add(kv_id)
        for dest in self.outbound.pop(kv_id, set()):
            self.plane.nodes[dest].abort_landing(kv_id)  # the transfer is cut off
        self.staged.pop(kv_id, None)
        return self.release(kv_id, "cancelled") or found
