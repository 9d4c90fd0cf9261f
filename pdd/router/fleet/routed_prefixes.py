"""What the router recently sent each worker: an LRU of prompt block chains per worker.

Used for the two caches the router cannot see at once:
  - P's vLLM prefix cache publishes nothing: the router records each prompt against the P it
    routed it to, and takes the leading blocks found in that P's LRU as the prefix P most
    likely still holds (``pdd.router.decide.policy.p_score``).
  - MD's DRC does publish (``drc_views``), but only as of the last health poll: the blocks of
    a turn that just finished may not be in the replica yet when the conversation's next turn
    arrives. The router also records each prompt against its MD, and the pool answers, per
    MD, the longer of the DRC replica's prefix and this one.
Either is an estimate (a worker may evict earlier): it steers choices between workers; what
is actually sent is decided by the worker's own answer (PrepareKv).

``record(worker, prompt, block_size)`` after each routing decision; ``cached_tokens(prompt,
{worker: block_size})`` per request; at most ``capacity`` hashes per worker (0: off). Chain
hashes (``pdd.cache.hashing``) name a block and everything before it, so the leading hashes
found are exactly the shared prefix. Used from the router's event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdd.cache.hashing import BlockHash, block_hashes, model_salt
from pdd.config import ModelConfig


class RoutedPrefixes:
    """One LRU of block hashes per worker id. ``capacity`` hashes each; 0 turns it off."""

    def __init__(self, model: ModelConfig, capacity: int):
        self._model = model
        self._capacity = capacity
        self._lru: dict[str, OrderedDict[BlockHash, None]] = {}

    def forget(self, worker_id: str) -> None:
        """Drop a worker's view (it left the fleet)."""
        self._lru.pop(worker_id, None)

    def hashes(
        self, prompt_token_ids: Sequence[int], block_size: int, cache_salt: str = ""
    ) -> list[BlockHash]:
        if block_size <= 0 or self._capacity <= 0:
            return []
        salt = model_salt(self._model.name, self._model.dtype, block_size, cache_salt)
        return block_hashes(prompt_token_ids, block_size, salt)

    def cached_tokens(
        self, prompt_token_ids: Sequence[int], block_sizes: dict[str, int], cache_salt: str = ""
    ) -> dict[str, int]:
        """Per worker id (with its block size), prompt tokens of the prefix it was recently sent."""
        out: dict[str, int] = {}
        by_size: dict[int, list[BlockHash]] = {}
        for worker_id, size in block_sizes.items():
            lru = self._lru.get(worker_id)
            if not lru or size <= 0:
                out[worker_id] = 0
                continue
            if size not in by_size:
                by_size[size] = self.hashes(prompt_token_ids, size, cache_salt)
            n = 0
            for h in by_size[size]:
                if h not in lru:
                    break
                n += 1
            out[worker_id] = n * size
        return out

    def record(
        self, worker_id: str, prompt_token_ids: Sequence[int], block_size: int, cache_salt: str = ""
    ) -> None:
        """The worker was sent this prompt: its blocks become the most recently used (the oldest
        are evicted, deepest first)."""
        hashes = self.hashes(prompt_token_ids, block_size, cache_salt)
        if not hashes:
            return
        lru = self._lru.setdefault(worker_id, OrderedDict())
        for h in reversed(hashes):  # parents end up newest: the LRU evicts leaves first
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self._capacity:
            lru.popitem(last=False)

    def size(self, worker_id: str) -> int:
        return len(self._lru.get(worker_id, ()))
