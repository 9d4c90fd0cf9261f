"""KV transfers to MainDecode that no request waits for any more, per MD.

When RLD ends a p_rld_md request before MD's KV landed, the rest of the prompt's KV is still
worth having on MD: the conversation's next turn starts with it. The router then sends
CancelKv(background) to P and MD (P sends the rest behind every other transfer, MD lands it
into its DRC) and remembers the transfer here.

A later request to the same MD whose prompt extends that prompt's whole blocks *supersedes*
it: its own transfer carries those blocks at full priority, so the deferred one is cancelled
(``superseded_by``) rather than sending them a second time. What already landed stays
(partial landing). Prompts are compared by their last whole block's chain hash
(``pdd.cache.hashing``: it names the block and everything before it), at MD's block size and
under the request's ``cache_salt``.

At most ``capacity`` per MD (the oldest are forgotten and end on their own: landed, or P's
send deadline); an entry is dropped once its send deadline passed. Event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdd.cache.hashing import BlockHash, block_hashes, model_salt
from pdd.config import ModelConfig

CAPACITY = 64


@dataclass(frozen=True, slots=True)
class Deferred:
    kv_id: str
    p: str  # the P sending it
    blocks: int  # whole blocks of its prompt at MD's block size
    last: BlockHash  # chain hash of the last of them
    until: float  # when (time.monotonic) its send deadline passes


class DeferredKv:
    def __init__(self, model: ModelConfig, ttl_s: float, capacity: int = CAPACITY):
        self._model = model
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._by_md: dict[str, OrderedDict[str, Deferred]] = {}

    def add(self, md: str, kv_id: str, p: str, prompt_token_ids: Sequence[int],
            block_size: int, cache_salt: str, now: float) -> None:  # fmt: skip
        hashes = self._hashes(prompt_token_ids, block_size, cache_salt)
        if not hashes:
            return  # no whole block: nothing was on its way
        entries = self._by_md.setdefault(md, OrderedDict())
        entries[kv_id] = Deferred(kv_id, p, len(hashes), hashes[-1], now + self._ttl_s)
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def superseded_by(self, md: str, prompt_token_ids: Sequence[int], block_size: int,
                      cache_salt: str, now: float) -> list[Deferred]:  # fmt: skip
        """Forget and return the transfers to ``md`` whose whole prompt blocks this prompt
        starts with (the caller cancels them); drop the expired ones."""
        entries = self._by_md.get(md)
        if not entries:
            return []
        for kv_id in [k for k, d in entries.items() if d.until <= now]:
            del entries[kv_id]
        hashes = self._hashes(prompt_token_ids, block_size, cache_salt)
        out = [d for d in entries.values()
               if d.blocks <= len(hashes) and hashes[d.blocks - 1] == d.last]  # fmt: skip
        for d in out:
            del entries[d.kv_id]
        return out

    def forget(self, md: str) -> None:
        """``md`` left the fleet."""
        self._by_md.pop(md, None)

    def _hashes(self, prompt: Sequence[int], block_size: int, cache_salt: str) -> list[BlockHash]:
        if block_size <= 0:
            return []
        salt = model_salt(self._model.name, self._model.dtype, block_size, cache_salt)
        return block_hashes(prompt, block_size, salt)
