"""MainDecode's own blocks: store the KV MD computed itself in the DRC.

Only WAN-landed blocks enter the DRC through PrepareKv. The blocks MD computes (the tokens
RLD emitted, its own output, a gap it recomputed) are what the *next* turn of the conversation
starts with (next prompt = this prompt + answer + new user text), so after a request finished
normally ``store`` keeps the whole blocks of ``prompt + output`` the DRC lacks:

    n = whole blocks with KV (the last sampled token has none yet)
    drc.reserve("own:<rid>", chain[:n])      c cached blocks pinned, landing slots for the rest
    engine request "<rid>.own": prompt = tokens[:n * block + 1], max_tokens 1,
        ExportParams(first_block=c, slots=the DRC's landing slots)
        -> vLLM's prefix cache holds the n blocks: it computes one token, and the connector
           copies blocks c..n-1 straight into their DRC landing slots (the DRC's host tier
           is the engine's arena): no scratch, no second copy, nothing for the c it holds
    final output: drc.land each exported block (committed in chain order)
    fence (the engine is done with the slots): discard what never landed, drc.release

So a finished request costs MD its new blocks only, and a context of any length is stored
when the DRC has room for its new blocks. The next turn's PrepareKv usually arrives right
after this turn ended: it ``settle``s first, waiting (at most SETTLE_WAIT_S) for a store of
the same conversation (same first block). Best effort: any failure only means fewer cached
blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import aclosing

from pdd.cache.drc import DecodeRadixCache
from pdd.cache.hashing import BlockHash
from pdd.engine.connector_params import ExportParams, FenceRef, wrap
from pdd.engine.types import SamplingSpec
from pdd.errors import PddError
from pdd.worker.kv_run import REAL_FINISHES, exported_blocks, run_with_kv
from pdd.worker.roles import GenerateCall

log = logging.getLogger(__name__)

GREEDY_ONE = SamplingSpec(temperature=0.0, max_tokens=1, ignore_eos=True)
SETTLE_WAIT_S = 0.5  # PrepareKv waits at most this for a store of the same conversation


class OwnBlocks:
    def __init__(
        self,
        engine,
        plane,
        drc: DecodeRadixCache,
        hashes: Callable[[list[int], str], list[BlockHash]],
    ) -> None:
        self._engine = engine
        self._plane = plane
        self._drc = drc
        self._hashes = hashes
        self._block_size = drc.block_size
        self._tasks: dict[asyncio.Task[None], BlockHash] = {}  # -> first block of its chain
        self.stored_blocks = 0  # blocks the engine copied into the DRC: new ones only

    def store(self, request_id: str, tokens: list[int], cache_salt: str = "") -> None:
        """Start storing the blocks of ``tokens`` the DRC lacks (background, best effort), in
        the prefix-cache namespace ``cache_salt``."""
        n = (len(tokens) - 1) // self._block_size
        if n == 0:
            return
        chain = self._hashes(tokens[: n * self._block_size], cache_salt)
        if self._drc.match(chain).cached_blocks >= n:
            return
        prompt = tokens[: n * self._block_size + 1]
        store = self._store(request_id, prompt, chain, cache_salt)
        task = asyncio.get_running_loop().create_task(store)
        self._tasks[task] = chain[0]
        task.add_done_callback(lambda t: self._tasks.pop(t, None))

    async def settle(self, chain: list[BlockHash]) -> None:
        """Wait (bounded) for stores of the same conversation (same first block) to land:
        the next turn's PrepareKv arrives right after the previous turn ended."""
        same = [t for t, first in self._tasks.items() if chain and first == chain[0]]
        if same:
            await asyncio.wait(same, timeout=SETTLE_WAIT_S)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _store(
        self, request_id: str, prompt: list[int], chain: list[BlockHash], cache_salt: str
    ) -> None:
        owner = f"own:{request_id}"
        try:
            res = self._drc.reserve(owner, chain)
            slots = self._drc.landing_slots(owner)  # chain[first:], written by the engine
        except PddError as exc:  # no room (CacheFullError) or a store already running
            log.debug("not storing %s: %s", request_id, exc.message)
            return
        first, landed = res.cached_blocks, set[BlockHash]()
        call = GenerateCall(f"{request_id}.own", prompt, GREEDY_ONE, cache_salt=cache_salt)

        def params(fence: FenceRef) -> dict:
            return wrap(export=ExportParams(slots=slots, first_block=first, fence=fence))

        def release() -> None:  # the engine will not write the slots any more
            for block_hash in res.receive:
                if block_hash not in landed:
                    self._drc.discard(owner, block_hash)
            self._drc.release(owner)

        stream = run_with_kv(self._engine, self._plane.fences, call, params, release)
        try:
            async with aclosing(stream):
                async for delta in stream:
                    if delta.finish_reason in REAL_FINISHES:  # every copy has run
                        done = exported_blocks(delta.kv_transfer_params)
                        for block_hash in chain[first:done]:
                            self._drc.land(owner, block_hash)
                            landed.add(block_hash)
                        self.stored_blocks += max(0, done - first)
        except PddError as exc:
            log.info("storing the blocks of %s failed: %s", request_id, exc.message)
