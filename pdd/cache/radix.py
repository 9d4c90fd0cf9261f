"""The radix index of the Decode-side RadixCache: which blocks are cached, pins, LRU order.

The index is a tree of whole KV blocks. A block is named by its chain hash
(pdd.cache.hashing), which already commits to every token before it, so each edge is one
block and needs no label; a node is found by its hash in O(1) and a prompt's cached prefix is
found by walking its hashes from the root until one is missing.

    root ── A ── B ── C ── D          conversation 1, turn 2: A B C D
             │         └── E          conversation 1, turn 2': A B C E  (C stored once)
             └── F ── G               conversation 2 with the same first block A

    match([A, B, C, X, ...]) -> 3 blocks (A B C), handles of A B C

Invariants:
  * Prefix-closed: a block is in the index only if its parent is (the root has no block).
    Insertion needs the parent present; eviction takes leaves only; ``remove`` takes a whole
    subtree. A router that sees the set of hashes can therefore answer prefix queries.
  * Dedup: a hash is stored once. Inserting a present hash keeps the stored handle and hands
    the offered one back as a duplicate for the caller to free.
  * Pins: ``refs`` counts pins per block. A block is *protected* while it or any descendant is
    pinned; a protected block is never evicted and never removed.
  * LRU: a logical clock ticks once per block touched (``insert`` and ``touch`` touch blocks in
    chain order, root side first), so every block has a distinct ``last_used``. ``evict(n)``
    repeats n times: take, among unprotected leaves, the one with the smallest ``last_used``.
    Evicting a leaf can make its parent a leaf, which then competes by its own ``last_used``.

The index only stores opaque integer handles (host-tier slots); it owns no memory and does no
I/O. Not thread-safe: the DecodeRadixCache facade serializes calls.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pdd.cache.hashing import BlockHash
from pdd.errors import CacheError


@dataclass(eq=False, slots=True)
class _Node:
    block_hash: BlockHash
    parent: _Node | None
    handle: int
    children: dict[BlockHash, _Node] = field(default_factory=dict)
    refs: int = 0  # pins on this block
    protected_children: int = 0  # children whose subtree holds a pin
    last_used: int = 0  # logical clock of the last touch

    @property
    def protected(self) -> bool:
        return self.refs > 0 or self.protected_children > 0


@dataclass(frozen=True, slots=True)
class IndexMatch:
    """The cached prefix of a hash chain: ``num_blocks`` leading blocks and their handles."""

    num_blocks: int
    handles: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class InsertResult:
    """``stored``: hashes that became new blocks; ``duplicates``: (hash, offered handle) pairs
    whose hash was already present (the stored handle wins; the caller frees the offered one)."""

    stored: tuple[BlockHash, ...]
    duplicates: tuple[tuple[BlockHash, int], ...]


class RadixIndex:
    """Prefix-closed block tree with pins and leaf-first LRU eviction (see module docstring)."""

    def __init__(self) -> None:
        self._nodes: dict[BlockHash, _Node] = {}
        self._clock = 0
        self._num_protected = 0
        # Lazy min-heap of (last_used, hash) for eviction candidates (unprotected leaves);
        # an entry is live only while the node still exists, is a candidate and was not
        # touched since the entry was pushed (ticks are unique, so equality proves it).
        self._heap: list[tuple[int, BlockHash]] = []

    # --- queries -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._nodes

    def hashes(self) -> Iterator[BlockHash]:
        """Every cached block hash (in insertion order)."""
        return iter(self._nodes)

    def handle(self, block_hash: BlockHash) -> int:
        return self._get(block_hash).handle

    def parent_of(self, block_hash: BlockHash) -> BlockHash | None:
        parent = self._get(block_hash).parent
        return None if parent is None else parent.block_hash

    def refs(self, block_hash: BlockHash) -> int:
        return self._get(block_hash).refs

    def pinned(self) -> dict[BlockHash, int]:
        """Pinned blocks and their pin counts (empty when every owner has released)."""
        return {h: n.refs for h, n in self._nodes.items() if n.refs}

    @property
    def num_evictable(self) -> int:
        """Blocks that repeated leaf eviction can remove now: those with no pin at or below."""
        return len(self._nodes) - self._num_protected

    def count_unprotected(self, hashes: Sequence[BlockHash]) -> int:
        """How many of these (distinct) cached blocks hold no pin at or below them: pinning a
        chain from block 0 lowers ``num_evictable`` by exactly this much."""
        return sum(1 for h in hashes if h in self._nodes and not self._nodes[h].protected)

    def match(self, hashes: Sequence[BlockHash]) -> IndexMatch:
        """Longest cached prefix of ``hashes`` (a chain from block 0). Pure: no LRU update."""
        handles: list[int] = []
        parent: _Node | None = None
        for h in hashes:
            node = self._nodes.get(h)
            if node is None or node.parent is not parent:
                break
            handles.append(node.handle)
            parent = node
        return IndexMatch(len(handles), tuple(handles))

    # --- mutations ---------------------------------------------------------------------------

    def insert(
        self,
        hashes: Sequence[BlockHash],
        handles: Sequence[int],
        parent: BlockHash | None = None,
    ) -> InsertResult:
        """Insert a chain: ``hashes[0]`` is a child of ``parent`` (None: of the root), each next
        hash a child of the one before. Touches every block of the chain, in order.

        Raises CacheError if ``parent`` is not cached or a present hash sits under another
        parent (a hash collision or a caller mixing chains); nothing is changed then.
        """
        if len(hashes) != len(handles):
            raise CacheError(f"{len(hashes)} hashes but {len(handles)} handles")
        at = None if parent is None else self._get(parent)
        self._check_chain(hashes, at)
        stored: list[BlockHash] = []
        duplicates: list[tuple[BlockHash, int]] = []
        for h, handle in zip(hashes, handles, strict=True):
            node = self._nodes.get(h)
            if node is None:
                node = self._new_node(h, at, handle)
                stored.append(h)
            else:
                duplicates.append((h, handle))
            self._touch(node)
            at = node
        return InsertResult(tuple(stored), tuple(duplicates))

    def touch(self, hashes: Sequence[BlockHash]) -> int:
        """Mark the cached prefix of ``hashes`` as just used (root side first); returns its
        length in blocks."""
        parent: _Node | None = None
        count = 0
        for h in hashes:
            node = self._nodes.get(h)
            if node is None or node.parent is not parent:
                break
            self._touch(node)
            parent = node
            count += 1
        return count

    def pin(self, block_hash: BlockHash) -> None:
        """Add one pin: the block and its ancestors cannot be evicted or removed."""
        node = self._get(block_hash)
        was = node.protected
        node.refs += 1
        if not was:
            self._propagate(node, +1)

    def unpin(self, block_hash: BlockHash) -> None:
        """Drop one pin. Raises CacheError if the block holds none."""
        node = self._get(block_hash)
        if node.refs == 0:
            raise CacheError(f"unpin of block {block_hash.hex()} that holds no pin")
        node.refs -= 1
        if not node.protected:
            self._propagate(node, -1)
            self._push_if_candidate(node)

    def evict(self, n: int) -> list[tuple[BlockHash, int]]:
        """Evict up to ``n`` blocks, least recently used unprotected leaf first.

        Returns (hash, handle) in eviction order; fewer than ``n`` only when nothing else is
        evictable (``num_evictable``).
        """
        out: list[tuple[BlockHash, int]] = []
        while len(out) < n and self._heap:
            tick, h = heapq.heappop(self._heap)
            node = self._nodes.get(h)
            if node is None or node.last_used != tick or not self._is_candidate(node):
                continue
            self._unlink(node)
            out.append((h, node.handle))
        return out

    def remove(self, block_hash: BlockHash) -> list[tuple[BlockHash, int]]:
        """Remove a block and its whole subtree (e.g. its bytes failed a check).

        Returns (hash, handle) children before parents (post-order, siblings in insertion
        order), so the index stays prefix-closed after each step. Raises CacheError if a
        block of the subtree is pinned; nothing is removed then.
        """
        node = self._get(block_hash)
        if node.protected:
            raise CacheError(f"remove of block {block_hash.hex()}: its subtree is pinned")
        order: list[_Node] = []
        self._post_order(node, order)
        for victim in order:
            self._unlink(victim)
        return [(v.block_hash, v.handle) for v in order]

    # --- internals ---------------------------------------------------------------------------

    def _get(self, block_hash: BlockHash) -> _Node:
        node = self._nodes.get(block_hash)
        if node is None:
            raise CacheError(f"block {block_hash.hex()} is not cached")
        return node

    def _check_chain(self, hashes: Sequence[BlockHash], at: _Node | None) -> None:
        """Every present hash of the chain must sit under the chain's previous block."""
        new_seen = False
        if len(set(hashes)) != len(hashes):
            raise CacheError("a hash chain repeats a block hash")
        for h in hashes:
            node = self._nodes.get(h)
            if node is None:
                new_seen = True
            elif new_seen or node.parent is not at:
                raise CacheError(f"block {h.hex()} is cached under another parent")
            at = node

    def _new_node(self, h: BlockHash, parent: _Node | None, handle: int) -> _Node:
        node = _Node(h, parent, handle)
        self._nodes[h] = node
        if parent is not None:
            parent.children[h] = node
        return node

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        node.last_used = self._clock
        self._push_if_candidate(node)

    @staticmethod
    def _is_candidate(node: _Node) -> bool:
        return not node.children and not node.protected

    def _push_if_candidate(self, node: _Node) -> None:
        if self._is_candidate(node):
            heapq.heappush(self._heap, (node.last_used, node.block_hash))
            if len(self._heap) > 2 * len(self._nodes) + 64:
                self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [(n.last_used, h) for h, n in self._nodes.items() if self._is_candidate(n)]
        heapq.heapify(self._heap)

    def _propagate(self, node: _Node, delta: int) -> None:
        """``node`` just became protected (+1) or unprotected (-1): update the counts of its
        ancestors up to the first whose own protected status does not change."""
        self._num_protected += delta
        parent = node.parent
        while parent is not None:
            was = parent.protected
            parent.protected_children += delta
            if parent.protected == was:
                return
            self._num_protected += delta
            parent = parent.parent

    def _unlink(self, node: _Node) -> None:
        """Drop an unprotected leaf; its parent may become an eviction candidate."""
        del self._nodes[node.block_hash]
        parent = node.parent
        if parent is not None:
            del parent.children[node.block_hash]
            self._push_if_candidate(parent)

    def _post_order(self, node: _Node, out: list[_Node]) -> None:
        stack: list[tuple[_Node, bool]] = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if expanded:
                out.append(current)
                continue
            stack.append((current, True))
            for child in reversed(list(current.children.values())):
                stack.append((child, False))
