"""Worker half of PddConnector: copies KV blocks between vLLM's paged cache and arena slots.

Runs in vLLM's worker (the engine-core process with the "uni" executor, a child of it with
"mp"), on the model-runner thread. Every copy is synchronous, on that thread:

- ``load`` (``start_load_kv``, before the forward of a step with sync loads): slots -> blocks;
  first it posts the fences the scheduler half sent (requests finished in earlier steps).
- ``save`` (``wait_for_save``, after the forward): blocks this step computed -> slots; the
  progress it reached goes back to the scheduler half, which posts it once every rank's copy of
  the step is in.

Owns: the block copier, the attached arena and fence board (mapped here, owned by the worker
shell), and the per-step copy statistics. Holds no request state: the scheduler half decides
every copy.

Tensor parallelism: every rank runs a worker half over its own paged cache, which holds only
its KV heads (``kv_copy.HeadShard``). A slot always holds a whole block, every head, in the
layout below, so P's and MD's tensor-parallel degrees never show on the wire: each rank copies
its heads' bytes of each layer block (contiguous in vLLM's CPU block, where heads come first;
strided in other layouts: kv_copy.py), and ranks holding a replicated head write the same
bytes.

Two copiers, picked at ``register_kv_caches`` from the tensors (layout rule: kv_copy.py):
- ``SlotCopier`` (numpy views, ``PagedKv``): vLLM's CPU layout, contiguous block-first CPU
  tensors; the fast path on CPU.
- ``kv_copy.TorchBlockCopier`` (torch ops): CUDA tensors, K/V-split or strided layouts.

Wire layout of one slot (``KvLayout``; the same on P and D, checked via slot_bytes):

    slot = | layer 0 block | layer 1 block | ... | layer L-1 block |
    layer block (CPU) = [num_kv_heads, block_size, 2 * head_dim] of the KV dtype (K, V packed)
    layer block (other layouts) = see kv_copy.py (block-first: t[b]; K/V-split: K then V)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pdd.cache.arena import FenceBoard, SlotArena
from pdd.engine.connector_meta import CopyJob, CopyStat, PddConnectorMetadata, PddWorkerMetadata
from pdd.engine.connector_params import ConnectorSettings
from pdd.engine.kv_copy import HeadShard, PagedLayers, TorchBlockCopier
from pdd.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvLayout:
    """Shape of one engine's paged KV cache as the arena sees it."""

    layer_names: tuple[str, ...]
    layer_block_bytes: int  # bytes of one block in one layer
    dtype: str  # e.g. "torch.float32"
    block_shape: tuple[int, ...]  # one layer's block, e.g. (num_kv_heads, block_size, 2*head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: one arena slot."""
        return self.layer_block_bytes * len(self.layer_names)


class PagedKv:
    """uint8 views of vLLM's per-layer KV tensors, each [num_blocks, layer_block_bytes].

    Needs every layer as one contiguous tensor with the block index first (vLLM's CPU layout
    [num_blocks, num_kv_heads, block_size, 2 * head_dim]); raises ConfigError otherwise.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        for name, t in kv_caches.items():
            if not t.is_contiguous() or t.shape != first.shape or t.dtype != first.dtype:
                raise ConfigError(f"KV layer {name}: unsupported layout {tuple(t.shape)}")
        self.layout = KvLayout(
            layer_names=tuple(kv_caches),
            layer_block_bytes=first[0].numel() * first.element_size(),
            dtype=str(first.dtype),
            block_shape=tuple(first.shape[1:]),
        )
        # numpy views share memory with vLLM's tensors: writes land in the paged cache. (numpy
        # copies of single blocks cost ~2x less per call than torch's; CPU tensors only.)
        self.layers = [t.view(torch.uint8).view(t.shape[0], -1).numpy() for t in kv_caches.values()]


class SlotCopier:
    """Copies whole blocks, all layers, between a PagedKv and a SlotArena: of a
    tensor-parallel rank, its ``shard`` of each block's heads."""

    def __init__(self, kv: PagedKv, arena: SlotArena, shard: HeadShard | None = None) -> None:
        layout = kv.layout
        if shard is None:  # one rank: every head
            shard = HeadShard(0, layout.block_shape[0], layout.block_shape[0])
        if layout.block_shape[0] != shard.count:
            raise ConfigError(f"KV block {layout.block_shape}: expected {shard.count} heads first")
        head_bytes = layout.layer_block_bytes // shard.count
        slot_bytes = layout.block_bytes // shard.count * shard.total
        if arena.slot_bytes != slot_bytes:
            raise ConfigError(
                f"arena {arena.ref.name!r} has {arena.slot_bytes}-byte slots, but one KV block "
                f"of this engine is {slot_bytes} bytes ({len(layout.layer_names)} layers x "
                f"{shard.total} heads x {head_bytes}, {layout.dtype})"
            )
        L = len(kv.layers)  # noqa: N806
        self._layers = [t.reshape(t.shape[0], shard.count, head_bytes) for t in kv.layers]
        # [num_slots, num_layers, heads, head_bytes] -> this rank's heads; shares memory with
        # the arena.
        flat = np.frombuffer(arena.buffer, dtype=np.uint8)
        slots = flat.reshape(arena.num_slots, L, shard.total, head_bytes)
        self._slots = slots[:, :, shard.start : shard.start + shard.count]

    def save(self, block_ids: tuple[int, ...], slots: tuple[int, ...]) -> None:
        """Paged blocks -> slots (one block of every layer per slot)."""
        for b, s in zip(block_ids, slots, strict=True):
            dst = self._slots[s]
            for i, layer in enumerate(self._layers):
                dst[i] = layer[b]

    def load(self, slots: tuple[int, ...], block_ids: tuple[int, ...]) -> None:
        """Slots -> paged blocks."""
        for s, b in zip(slots, block_ids, strict=True):
            src = self._slots[s]
            for i, layer in enumerate(self._layers):
                layer[b] = src[i]

    def close(self) -> None:
        self._slots = None  # drop the arena view before the arena is unmapped


class WorkerHalf:
    def __init__(
        self,
        settings: ConnectorSettings,
        num_blocks: int | None = None,
        shard: HeadShard | None = None,
    ) -> None:
        """``num_blocks``: vLLM's ``KVCacheConfig.num_blocks``, for layout detection (kv_copy);
        ``shard``: the KV heads this rank holds."""
        self._settings = settings
        self._num_blocks = num_blocks
        self._shard = shard
        self._copier: SlotCopier | TorchBlockCopier | None = None
        self._arena: SlotArena | None = None
        self._fences: FenceBoard | None = None
        self._out = PddWorkerMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the shell's arenas; raises ConfigError (engine start fails) when they do not fit."""
        layers = PagedLayers.from_caches(kv_caches, self._num_blocks)
        self._arena = SlotArena.attach_ref(self._settings.arena)
        try:
            if layers.is_cpu_packed:
                self._copier = SlotCopier(PagedKv(kv_caches), self._arena, self._shard)
            else:
                self._copier = TorchBlockCopier(layers, self._arena, shard=self._shard)
        except ConfigError:
            self._arena.close()
            self._arena = None
            raise
        if self._settings.fences is not None:
            self._fences = FenceBoard.attach(self._settings.fences)
        log.info("PddConnector: arena %s, %d slots of %d bytes, %s copier%s",
                 self._arena.ref.name, self._arena.num_slots, self._arena.slot_bytes,
                 type(self._copier).__name__, f" ({self._copier.host})"
                 if isinstance(self._copier, TorchBlockCopier) else "")  # fmt: skip

    # --- called by the model runner each step -----------------------------------------------

    def load(self, meta: PddConnectorMetadata) -> None:
        """Post fences, then copy this step's loads (before the forward that reads them)."""
        for index, ticket in meta.fences:
            assert self._fences is not None, "fence without a board (scheduler checks this)"
            self._fences.post(index, ticket)
        for job in meta.loads:
            self._out.loads[job.req_id] = self._copy(job, self._c().load, job.slots, job.block_ids)

    def save(self, meta: PddConnectorMetadata) -> None:
        """Copy the blocks this step's forward computed into their slots; report how far each
        request's slots are filled (the copy is synchronous: the bytes are there)."""
        for job in meta.saves:
            stat = self._copy(job, self._c().save, job.block_ids, job.slots)
            if job.progress is not None:
                index, end = job.progress
                self._out.progress[index] = max(end, self._out.progress.get(index, 0))
            prev = self._out.saves.get(job.req_id)
            self._out.saves[job.req_id] = prev + stat if prev else stat

    def _copy(self, job: CopyJob, fn, src: tuple[int, ...], dst: tuple[int, ...]) -> CopyStat:
        started = time.perf_counter()
        fn(src, dst)
        return CopyStat(len(job.slots), time.perf_counter() - started)

    def take_worker_meta(self) -> PddWorkerMetadata | None:
        if not self._out.loads and not self._out.saves and not self._out.progress:
            return None
        out, self._out = self._out, PddWorkerMetadata()
        return out

    def shutdown(self) -> None:
        """Unmap the arenas (the shell owns and unlinks them)."""
        if self._copier is not None:
            self._copier.close()
        if self._fences is not None:
            self._fences.close()
        if self._arena is not None:
            self._arena.close()

    def _c(self) -> SlotCopier | TorchBlockCopier:
        assert self._copier is not None, "copy before register_kv_caches"
        return self._copier
