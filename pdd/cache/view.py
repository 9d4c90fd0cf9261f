"""Router-side replica of one MainDecode's DRC contents: how much of a prompt it holds.

The router owns one PrefixIndexView per MainDecode instance. It is fed typed messages
(pdd.cache.messages), never talks to anything itself, and answers prefix queries purely:

    view.apply_snapshot(snap)            # start, or after a gap: the whole set at seq S
    view.apply_events(batch) -> bool     # deltas S+1, S+2, ...; False: gap -> resync
    view.cached_tokens(prompt_hashes)    # tokens of the prompt's cached whole-block prefix

Because the cache is prefix-closed (pdd.cache.radix), a set of hashes is enough: the cached
prefix of a prompt is its leading hashes that are in the set.

A stale view (never synced, a sequence gap, another epoch) keeps answering from the last state
it applied; ``stale`` tells the policy to discount it. Never imports torch, vLLM or numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdd.cache.hashing import BlockHash
from pdd.cache.messages import BlockStored, DrcEventBatch, DrcSnapshot


class PrefixIndexView:
    """The set of block hashes one DRC holds, as of event ``seq`` of ``epoch``."""

    def __init__(self) -> None:
        self._blocks: set[BlockHash] = set()
        self._epoch: str | None = None
        self._seq = 0
        self._block_size = 0
        self._stale = True

    @property
    def stale(self) -> bool:
        """True until a snapshot is applied and again after a gap or an epoch change."""
        return self._stale

    @property
    def epoch(self) -> str | None:
        return self._epoch

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def block_size(self) -> int:
        return self._block_size

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> frozenset[BlockHash]:
        return frozenset(self._blocks)

    def apply_snapshot(self, snapshot: DrcSnapshot) -> None:
        """Replace the whole state; the view is fresh at ``snapshot.seq``."""
        self._blocks = set(snapshot.block_hashes)
        self._epoch = snapshot.epoch
        self._seq = snapshot.seq
        self._block_size = snapshot.block_size
        self._stale = False

    def apply_events(self, batch: DrcEventBatch) -> bool:
        """Apply the events after ``seq``; events at or before it are skipped (re-delivery).

        Returns False and marks the view stale (state left at the last contiguous event) when
        the batch is from another epoch, skips a number, or ends before ``batch.last_seq``.
        """
        if self._stale or batch.epoch != self._epoch:
            self._stale = True
            return False
        for event in batch.events:
            if event.seq <= self._seq:
                continue
            if event.seq != self._seq + 1:
                self._stale = True
                return False
            if isinstance(event, BlockStored):
                self._blocks.update(event.block_hashes)
            else:
                self._blocks.difference_update(event.block_hashes)
            self._seq = event.seq
        if batch.last_seq > self._seq:
            self._stale = True
            return False
        return True

    def cached_blocks(self, prompt_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of the prompt's chain that the DRC holds."""
        n = 0
        for h in prompt_hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def cached_tokens(self, prompt_hashes: Sequence[BlockHash]) -> int:
        """Prompt tokens the DRC holds (whole blocks only)."""
        return self.cached_blocks(prompt_hashes) * self._block_size
