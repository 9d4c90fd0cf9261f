"""Block copies between vLLM's paged KV tensors and arena slots, on any torch device.

Owns: layout detection for one engine's set of per-layer KV tensors (``PagedLayers``) and
``TorchBlockCopier``, which copies whole blocks (all layers) to arena slots and back with torch
ops: on CUDA a device<->host copy, on CPU a plain copy. Imports neither vLLM nor pydantic (the
arena is any object with ``buffer``, ``num_slots`` and ``slot_bytes``, e.g. ``SlotArena``).

Layouts of one layer's tensor (all layers must be alike; N = num_blocks):

    block-first  [N, *block]      block dim 0. vLLM 0.32 CPU and FlashAttention: [N, H, B, 2D]
                                  (K and V packed per head); FlashInfer: [N, 2, B, H, D]
    K/V-split    [2, N, *half]    block dim 1. FlashAttention before 0.32: [2, N, B, H, D]

Detection rule (``detect_block_dim``), on the logical shape vLLM hands over:
    with N known (vLLM's ``KVCacheConfig.num_blocks``):
        block-first iff shape[0] == N;  K/V-split iff ndim >= 3, shape[0] == 2, shape[1] == N
    without N:
        K/V-split iff ndim >= 3 and shape[0] == 2;  block-first iff ndim >= 2 and shape[0] != 2
    exactly one must hold; none or both (e.g. [2, 2, ...]) is a ConfigError naming the shape.
Strides do not matter (vLLM may permute the physical order, e.g. FlashInfer's HND).

Wire layout of one slot (P and D must agree; ``slot_bytes`` checks only the size):

    slot        = | layer 0 block | layer 1 block | ... | layer L-1 block |   (registration order)
    layer block = t[b]              block-first: the block's sub-tensor, row-major logical order
                = t[0, b] | t[1, b] K/V-split:   K bytes, then V bytes, each row-major
    (FlashInfer [N, 2, B, H, D] and split [2, N, B, H, D] give the same bytes: K then V.)

Copy path (save; load runs it backwards and ends with ``index_copy_`` into the paged tensors):

    paged tensors --index_select per layer--> device staging [C, L, E] (C blocks per chunk)
        --D2H--> arena slots   ("register": the arena is cudaHostRegister-ed, copies go
                                straight into the slots; "staging": into a pinned buffer,
                                then a CPU copy into the slots; "cpu": CPU tensors)

Tensor parallelism (``HeadShard``): a rank's paged tensors hold only its KV heads, but a slot
always holds every head of the block, in the wire layout above (so the degrees of P and MD
never show on the wire). A rank's copier reads and writes only its heads' part of each layer
block: the KV-head axis of the logical block (``PagedLayers.head_axis``: [H, B, 2D] axis 0,
[2, B, H, D] axis 2), a strided CPU copy between the slot and a compact host row; on CUDA
through the pinned staging buffer (``host`` "auto" picks "staging"; "register" is refused).
Ranks holding a replicated head write the same bytes.

Every call synchronizes its stream before it returns: the caller frees or reuses slots at once.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from pdd.errors import CacheError, ConfigError

log = logging.getLogger(__name__)

BLOCK_FIRST = 0  # block dim of a block-first layout
KV_SPLIT = 1  # block dim of a K/V-split layout
HOST_MODES = ("auto", "register", "staging")
DEFAULT_CHUNK_BYTES = 64 << 20  # device (and pinned) staging: bounds extra device memory


class SlotMemory(Protocol):
    """What the copier needs of an arena (``pdd.cache.arena.SlotArena`` fits)."""

    @property
    def buffer(self) -> memoryview: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...


@dataclass(frozen=True)
class HeadShard:
    """The KV heads one tensor-parallel rank holds: ``start .. start + count`` of ``total``."""

    start: int
    count: int
    total: int

    @classmethod
    def of_rank(cls, rank: int, world: int, total: int) -> HeadShard:
        """vLLM's split: ``total // world`` heads a rank, or one replicated head each when
        there are more ranks than heads (``world`` a multiple of ``total``)."""
        if total % world and world % total:
            raise ConfigError(f"{total} KV heads cannot be split over {world} ranks")
        return cls(rank * total // world, max(1, total // world), total)

    @property
    def whole(self) -> bool:
        return self.count == self.total


def detect_block_dim(shape: tuple[int, ...], num_blocks: int | None = None) -> int:
    """BLOCK_FIRST (0) or KV_SPLIT (1) for one layer's logical shape (rule: module docstring).

    Raises ConfigError naming the shape when no layout or both layouts match.
    """
    shape = tuple(shape)
    split = len(shape) >= 3 and shape[0] == 2
    if num_blocks is None:
        first = len(shape) >= 2 and (shape[0] != 2 or (split and shape[1] == 2))
    else:
        first = len(shape) >= 2 and shape[0] == num_blocks
        split = split and shape[1] == num_blocks
    known = f" with {num_blocks} blocks" if num_blocks is not None else ""
    if first and split:
        raise ConfigError(f"KV cache shape {shape}{known} is ambiguous: block-first or K/V-split")
    if not first and not split:
        raise ConfigError(
            f"KV cache shape {shape}{known} is not a supported layout: expected "
            "[num_blocks, ...] (block-first) or [2, num_blocks, ...] (K/V-split)"
        )
    return BLOCK_FIRST if first else KV_SPLIT


@dataclass(frozen=True)
class PagedLayers:
    """One engine's per-layer KV tensors, validated alike, with their detected layout."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    block_dim: int  # BLOCK_FIRST or KV_SPLIT
    num_blocks: int
    block_shape: tuple[int, ...]  # one layer block on the wire, e.g. (2, B, H, D)
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_caches(
        cls, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None
    ) -> PagedLayers:
        """Validate vLLM's ``register_kv_caches`` dict; ConfigError naming the offending shape."""
        if not kv_caches:
            raise ConfigError("no KV cache layers to copy")
        first = next(iter(kv_caches.values()))
        for name, t in kv_caches.items():
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ConfigError(
                    f"KV layer {name}: {tuple(t.shape)} {t.dtype} on {t.device} differs from "
                    f"the first layer's {tuple(first.shape)} {first.dtype} on {first.device}"
                )
        shape = tuple(first.shape)
        block_dim = detect_block_dim(shape, num_blocks)
        block_shape = shape[1:] if block_dim == BLOCK_FIRST else (2, *shape[2:])
        return cls(
            names=tuple(kv_caches),
            tensors=tuple(kv_caches.values()),
            block_dim=block_dim,
            num_blocks=shape[block_dim],
            block_shape=block_shape,
            dtype=first.dtype,
            device=first.device,
        )

    @property
    def layer_block_elems(self) -> int:
        return math.prod(self.block_shape)

    @property
    def layer_block_bytes(self) -> int:
        return self.layer_block_elems * torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: one arena slot."""
        return self.layer_block_bytes * len(self.tensors)

    @property
    def head_axis(self) -> int | None:
        """Index of the KV-head axis in ``block_shape``: [H, B, 2D] (vLLM 0.32's logical block,
        every backend) 0; [2, B, H, D] (FlashInfer before 0.32, K/V-split) 2; None for any
        other shape (e.g. an MLA latent [B, C], which has no heads to split)."""
        if len(self.block_shape) == 3:
            return 0
        if len(self.block_shape) == 4 and self.block_shape[0] == 2:
            return 2
        return None

    @property
    def is_cpu_packed(self) -> bool:
        """vLLM's CPU layout: contiguous block-first CPU tensors (the numpy fast path's case)."""
        return (
            self.device.type == "cpu"
            and self.block_dim == BLOCK_FIRST
            and all(t.is_contiguous() for t in self.tensors)
        )


def wire_block_shape(layers: PagedLayers, shard: HeadShard | None) -> tuple[int, ...]:
    """One layer block as a slot holds it: ``layers.block_shape`` with every KV head of the
    model (a rank's ``shard`` holds ``shard.count`` of ``shard.total``). ConfigError when
    the rank's blocks do not hold its heads on a known axis."""
    if shard is None or shard.whole:
        return layers.block_shape
    axis = layers.head_axis
    if axis is None or layers.block_shape[axis] != shard.count:
        raise ConfigError(
            f"tensor parallelism: KV block {layers.block_shape} does not hold this rank's "
            f"{shard.count} of {shard.total} KV heads on its head axis "
            f"({'none known' if axis is None else axis})"
        )
    return (*layers.block_shape[:axis], shard.total, *layers.block_shape[axis + 1 :])


def check_slot_bytes(
    layers: PagedLayers, slots: SlotMemory, shard: HeadShard | None = None
) -> None:
    """ConfigError unless one arena slot holds exactly one block of every layer, every head."""
    wire = wire_block_shape(layers, shard)
    layer_bytes = layers.layer_block_bytes // layers.layer_block_elems * math.prod(wire)
    if slots.slot_bytes != layer_bytes * len(layers.tensors):
        heads = "" if shard is None or shard.whole else f", {shard.total} heads over the ranks"
        raise ConfigError(
            f"arena has {slots.slot_bytes}-byte slots, but one KV block of this engine is "
            f"{layer_bytes * len(layers.tensors)} bytes ({len(layers.tensors)} layers x "
            f"{layer_bytes}, {layers.dtype}, layer shape "
            f"{tuple(layers.tensors[0].shape)}{heads})"
        )


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(position, first slot, length) of each run where position and slot both step by one.

    slots [7, 8, 9, 2, 3] -> [(0, 7, 3), (3, 2, 2)]: one copy per run instead of per slot.
    """
    runs: list[tuple[int, int, int]] = []
    for j, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            j0, s0, k = runs[-1]
            runs[-1] = (j0, s0, k + 1)
        else:
            runs.append((j, s, 1))
    return runs


class _HostPins:
    """Process-wide cudaHostRegister of CPU ranges, counted per (address, length).

    CUDA refuses to register a range twice (two copiers over one mapping of an arena, e.g. two
    engines in one process): the first copier registers, the others share it, the last
    ``release`` unregisters. Registration only speeds copies up (DMA straight into the slots);
    correctness never depends on it. Callers: the model-runner thread(s); hence the lock.
    """

    _lock = threading.Lock()
    _count: dict[tuple[int, int], int] = {}

    @classmethod
    def acquire(cls, t: torch.Tensor) -> bool:
        """Page-lock the memory under ``t``; False (logged) when CUDA refuses."""
        key = (t.data_ptr(), t.numel() * t.element_size())
        with cls._lock:
            if key in cls._count:
                cls._count[key] += 1
                return True
            if not _cuda_register(*key):
                return False
            cls._count[key] = 1
            return True

    @classmethod
    def release(cls, t: torch.Tensor) -> None:
        key = (t.data_ptr(), t.numel() * t.element_size())
        with cls._lock:
            cls._count[key] -= 1
            if cls._count[key] == 0:
                del cls._count[key]
                rc = torch.cuda.cudart().cudaHostUnregister(key[0])
                if int(rc) != 0:
                    log.warning("cudaHostUnregister failed (cudaError %d)", int(rc))


def _cuda_register(ptr: int, nbytes: int) -> bool:
    try:
        rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    except (AttributeError, RuntimeError) as exc:
        log.info("cudaHostRegister unavailable: %s", exc)
        return False
    if int(rc) == 0:
        return True
    log.info("cudaHostRegister failed (cudaError %d): using a pinned staging buffer", int(rc))
    try:  # the failure stays in CUDA's last-error slot; a kernel launch check reads and clears it
        torch.empty(1, device="cuda").zero_()
    except RuntimeError:
        pass
    return False


class TorchBlockCopier:
    """Copies whole blocks, all layers, between ``PagedLayers`` and arena slots (any device).

    Owns a device staging buffer of ``chunk_bytes`` (rounded to whole blocks) and, in
    "staging" mode, a pinned host buffer of the same size; in "register" mode the arena's pages
    stay page-locked until ``close``. Call ``close`` before the arena is unmapped.
    ``host``: "auto" (register, falling back to staging), "register" or "staging"; ignored on
    CPU. ``shard``: the KV heads this tensor-parallel rank holds (None: every head); a rank
    copies through the staging buffer. Not thread-safe: one caller (vLLM's model-runner thread).
    """

    def __init__(
        self,
        layers: PagedLayers,
        slots: SlotMemory,
        *,
        shard: HeadShard | None = None,
        host: str = "auto",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if host not in HOST_MODES:
            raise ConfigError(f"host copy mode {host!r} is not one of {HOST_MODES}")
        check_slot_bytes(layers, slots, shard)
        self._layers = layers
        self._num_slots = slots.num_slots
        n_layers, b = len(layers.tensors), layers.layer_block_bytes
        # [num_slots, slot_bytes], sharing memory with the arena
        self._slots: torch.Tensor | None = torch.frombuffer(slots.buffer, dtype=torch.uint8).view(
            slots.num_slots, slots.slot_bytes
        )
        # a rank's heads of every slot: [num_slots, L, *block] in the KV dtype, strided
        self._heads: torch.Tensor | None = None
        if shard is not None and not shard.whole:
            axis = 2 + layers.head_axis  # type: ignore[operator]  # checked by check_slot_bytes
            whole = self._slots.view(layers.dtype).view(
                slots.num_slots, n_layers, *wire_block_shape(layers, shard)
            )
            self._heads = whole.narrow(axis, shard.start, shard.count)
        self.chunk_blocks = max(1, chunk_bytes // layers.block_bytes)
        # [C, L, E] in the KV dtype: row j = one slot's bytes (wire layout), of a rank its heads
        self._stage = torch.empty(
            (self.chunk_blocks, n_layers, b), dtype=torch.uint8, device=layers.device
        ).view(layers.dtype)
        self._pinned: torch.Tensor | None = None
        self._registered = False
        self.host = self._setup_host(host)

    def _setup_host(self, host: str) -> str:
        if self._layers.device.type != "cuda":
            return "cpu"
        if self._heads is not None and host == "register":
            raise ConfigError("a tensor-parallel rank copies its heads through a staging buffer "
                              "(host copy mode 'register' cannot)")  # fmt: skip
        if self._heads is None and host in ("auto", "register"):
            if _HostPins.acquire(self._slots):
                self._registered = True
                return "register"
            if host == "register":
                raise ConfigError(
                    "cudaHostRegister of the arena failed (host copy mode 'register')"
                )
        self._pinned = torch.empty(
            (self.chunk_blocks, self._stage[0].numel() * self._stage.element_size()),
            dtype=torch.uint8,
            pin_memory=True,
        )
        return "staging"

    # --- copies ---------------------------------------------------------------------------------

    def save(self, block_ids: tuple[int, ...], slots: tuple[int, ...]) -> None:
        """Paged blocks -> slots (one block of every layer per slot); complete on return."""
        self._check(block_ids, slots)
        idx, c = self._index(block_ids), self.chunk_blocks
        for at in range(0, len(block_ids), c):
            dst = list(slots[at : at + c])
            self._gather(idx[at : at + c], len(dst))
            self._to_slots(dst)
        self._sync()

    def load(self, slots: tuple[int, ...], block_ids: tuple[int, ...]) -> None:
        """Slots -> paged blocks; complete on return (the slots may be reused at once)."""
        self._check(block_ids, slots)
        idx, c = self._index(block_ids), self.chunk_blocks
        for at in range(0, len(block_ids), c):
            src = list(slots[at : at + c])
            self._from_slots(src)
            self._scatter(idx[at : at + c], len(src))
            if self.host == "staging":
                self._sync()  # the next chunk rewrites the pinned buffer
        self._sync()

    def close(self) -> None:
        """Unregister the arena's pages and drop every view of it. Idempotent."""
        if self._registered and self._slots is not None:
            self._sync()
            _HostPins.release(self._slots)
            self._registered = False
        self._slots = None
        self._heads = None
        self._pinned = None

    # --- steps ----------------------------------------------------------------------------------

    def _check(self, block_ids: tuple[int, ...], slots: tuple[int, ...]) -> None:
        # Checked on the host: an out-of-range index on CUDA is a device assert that poisons the
        # whole CUDA context (the engine dies), not an exception.
        if len(block_ids) != len(slots):
            raise CacheError(f"{len(block_ids)} blocks but {len(slots)} slots")
        if self._slots is None:
            raise CacheError("block copier is closed")
        if block_ids and not (0 <= min(block_ids) and max(block_ids) < self._layers.num_blocks):
            raise CacheError(f"block id out of range [0, {self._layers.num_blocks})")
        if slots and not (0 <= min(slots) and max(slots) < self._num_slots):
            raise CacheError(f"slot out of range [0, {self._num_slots})")

    def _index(self, ids: tuple[int, ...]) -> torch.Tensor:
        """Block ids on the device. Pinned + non_blocking: a pageable copy would wait for the
        stream, serializing the CPU's kernel launches with the previous chunk's copies."""
        idx = torch.tensor(ids, dtype=torch.long)
        if self._layers.device.type != "cuda":
            return idx
        return idx.pin_memory().to(self._layers.device, non_blocking=True)

    def _gather(self, idx: torch.Tensor, n: int) -> None:
        """Paged tensors -> self._stage[:n] (row j = block idx[j], all layers, wire layout)."""
        shape = (n, *self._layers.block_shape)
        for i, t in enumerate(self._layers.tensors):
            out = self._stage[:n, i].view(shape)  # [n, *block], rows L*E apart
            if self._layers.block_dim == KV_SPLIT:
                out = out.transpose(0, 1)  # [2, n, *half]: K then V within each row
            # one kernel per layer, writing the strided rows directly (no temporary)
            torch.index_select(t, self._layers.block_dim, idx, out=out)

    def _scatter(self, idx: torch.Tensor, n: int) -> None:
        """self._stage[:n] -> paged tensors (row j into block idx[j] of every layer)."""
        shape = (n, *self._layers.block_shape)
        for i, t in enumerate(self._layers.tensors):
            src = self._stage[:n, i].view(shape)  # [n, *block]
            if self._layers.block_dim == KV_SPLIT:
                src = src.transpose(0, 1)  # [2, n, *half]
            t.index_copy_(self._layers.block_dim, idx, src)

    def _to_slots(self, dst: list[int]) -> None:
        """self._stage[:len(dst)] -> arena slots dst (D2H on CUDA)."""
        rows = self._stage[: len(dst)].view(torch.uint8).view(len(dst), -1)  # [n, row_bytes]
        if self.host == "staging":
            assert self._pinned is not None
            self._pinned[: len(dst)].copy_(rows, non_blocking=True)
            self._sync()  # the CPU copy below reads the pinned buffer
            rows = self._pinned
        into, rows = self._slot_rows(rows)
        for j, s, k in _runs(dst):
            into[s : s + k].copy_(rows[j : j + k], non_blocking=True)

    def _from_slots(self, src: list[int]) -> None:
        """Arena slots src -> self._stage[:len(src)] (H2D on CUDA)."""
        rows = self._stage[: len(src)].view(torch.uint8).view(len(src), -1)
        via = self._pinned if self.host == "staging" else rows
        assert via is not None
        out_of, into = self._slot_rows(via)
        for j, s, k in _runs(src):
            into[j : j + k].copy_(out_of[s : s + k], non_blocking=True)
        if via is not rows:
            rows.copy_(via[: len(src)], non_blocking=True)

    def _slot_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the arena's slots, ``rows``) as alike tensors to copy runs between: whole slots
        and uint8 rows, or a rank's heads of each slot (strided) and the rows as its blocks."""
        assert self._slots is not None
        if self._heads is None:
            return self._slots, rows
        n_layers = len(self._layers.tensors)
        return self._heads, rows.view(self._layers.dtype).view(
            rows.shape[0], n_layers, *self._layers.block_shape
        )

    def _sync(self) -> None:
        if self._layers.device.type == "cuda":
            torch.cuda.current_stream(self._layers.device).synchronize()
