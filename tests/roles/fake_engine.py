"""A fake Engine that plays vLLM *and* PddConnector for unit tests of the role policies.

It speaks the same slot contract as the real connector (pdd/engine/connector.py): an export
writes prompt block i into ``slots[i]``, a load reads ``slots[i]`` for prompt block i, and the
request's fence is posted a moment after the request ended (like the engine step after it).
Block bytes are a pure function of the block's tokens *and everything before them*, so a
load can check that every slot holds exactly the right block. Tokens are a pure function of
the sequence: every tier continuing ``prompt + emitted`` yields what one engine would.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.cache.arena import FenceBoard, SlotArena
from pdd.engine.connector_params import ExportResult, LoadResult, RequestKvParams, wrap
from pdd.engine.types import EngineDelta, EngineStats, SamplingSpec
from pdd.errors import InvalidRequestError
from pdd.kv_geometry import KvGeometry

FENCE_DELAY_S = 0.01


def block_bytes(prefix: list[int], size: int) -> bytes:
    """The fake KV of the last block of ``prefix`` (depends on the whole prefix)."""
    seed = hashlib.blake2b(repr(prefix).encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def next_token(seq: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(repr(seq).encode(), digest_size=4).digest()) % 1000


@dataclass
class FakeEngine:
    arena: SlotArena
    board: FenceBoard
    block_size: int
    ready: bool = True
    loads: list[tuple[str, int, bool]] = field(default_factory=list)  # (rid, blocks, all ok)
    running: set[str] = field(default_factory=set)
    gate: asyncio.Event | None = None  # when set by a test: requests wait for it per token
    kv_geometry: KvGeometry | None = None  # what its KV is (pdd.kv_geometry); None: unknown
    # the bytes a loaded block must hold: P's block_bytes, or (a receiver that converts) P's
    # converted into its own geometry
    expect: Callable[[list[int], int], bytes] = block_bytes

    def validate(self, prompt: list[int], sampling: SamplingSpec) -> None:
        if not prompt:
            raise InvalidRequestError("prompt_token_ids must not be empty")

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), 0, 0.0, 0, 0, 0, 4096, self.block_size, 8, 0)

    async def generate(self, rid, prompt, sampling, kv_transfer_params=None, cache_salt=""):
        if rid in self.running:
            raise InvalidRequestError(f"request id {rid!r} is already running")
        params = RequestKvParams.parse(kv_transfer_params)
        self.running.add(rid)
        try:
            result = self._copy(rid, prompt, params)
            seq = list(prompt)
            n = sampling.max_tokens or 1
            for i in range(n):
                if self.gate is not None:
                    await self.gate.wait()
                await asyncio.sleep(0)
                seq.append(next_token(seq))
                last = i == n - 1
                yield EngineDelta(
                    (seq[-1],), None, "length" if last else None, None, len(prompt), 0,
                    result if last else None,
                )  # fmt: skip
        finally:
            self.running.discard(rid)
            fence = (params.export or params.load).fence if params else None
            if fence is not None:
                loop = asyncio.get_running_loop()
                loop.call_later(FENCE_DELAY_S, self.board.post, fence.index, fence.ticket)

    def _copy(self, rid: str, prompt: list[int], params: RequestKvParams | None):
        if params is None:
            return None
        bs, size = self.block_size, self.arena.slot_bytes
        if params.export is not None:
            slots, first = params.export.slots, params.export.first_block
            for i, slot in enumerate(slots, start=first):  # block first + i -> slots[i]
                self.arena.view(slot)[:] = block_bytes(prompt[: (i + 1) * bs], size)
            n = first + len(slots)
            return wrap(exported=ExportResult(num_blocks=n, num_tokens=n * bs, complete=True))
        slots = params.load.slots
        ok = all(
            bytes(self.arena.view(s)) == self.expect(prompt[: (i + 1) * bs], size)
            for i, s in enumerate(slots)
        )
        self.loads.append((rid, len(slots), ok))
        end = min(len(slots) * bs, len(prompt) - 1)
        loaded = LoadResult(num_blocks=len(slots), first_block=0, num_tokens=end, ok=ok)
        return wrap(loaded=loaded)
