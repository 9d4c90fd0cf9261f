"""PddConnector: pdd's vLLM KV connector (``KVConnectorBase_V1``, vLLM 0.32).

vLLM builds two instances per engine from ``KVTransferConfig(kv_connector="PddConnector",
kv_connector_module_path="pdd.engine.connector", kv_role=..., kv_connector_extra_config=
ConnectorSettings(...).model_dump())``: one with role SCHEDULER (engine-core process) and one
with role WORKER (same process with the "uni" executor, a child with "mp"). This class only
dispatches to the half for its role:

- ``SchedulerHalf`` (connector_scheduler.py): per-request bookkeeping, no bytes.
- ``WorkerHalf`` (connector_worker.py): synchronous copies between the paged cache and slots;
  one per tensor-parallel rank, each over its own KV heads.

The connector moves KV between vLLM's paged cache and the slots of a shared-memory arena
(pdd.cache.arena) that the worker shell owns. It knows nothing of peers, transports, hashes
or leases. Per request, in ``kv_transfer_params["pdd"]`` (typed in connector_params.py):

- ``export {slots}`` (kv_producer, P): prompt block i is copied into ``slots[i]`` right after
  the forward that computed it (with chunked prefill, earlier chunks' blocks in earlier steps).
  vLLM frees its blocks as usual when the request finishes. Result: ``exported``.
- ``load {slots}`` (kv_consumer, RLD/MD): prompt block i is copied from ``slots[i]`` into the
  paged cache before the forward of the request's first step; vLLM computes only the rest (at
  least the last prompt token). Blocks vLLM's own prefix cache holds are not copied. Result:
  ``loaded``.

Slot contract (the shell's side; the connector never checks slot contents):

1. Only whole prompt blocks travel: ``len(slots) <= len(prompt) // block_size``, distinct ids
   below ``arena.num_slots``; otherwise the params are refused (the request runs without
   them, and the result's ``error`` says why).
2. A load's slots hold complete, valid blocks when the request is submitted (the shell has
   waited for its transfer and checked it). A slot the shell marked invalid is never passed.
3. The shell keeps every slot of a request pinned (not freed, not reused, not written) from
   submission until the connector is done with it:
   - a request that finished normally: its final output (with ``exported``/``loaded``)
     proves it, since the copies run inside the engine steps that produced its outputs;
   - always, and the only safe signal after an abort: the request's ``fence`` ticket posted
     on the fence board (``arena.FenceBoard``). The frontend ends an aborted stream at once,
     while the engine core may still be running a step that copies for it; the worker posts
     the ticket in the first step scheduled after the engine core finished the request.
   - if the engine core died, nothing maps the slots any more.
4. P's slots are written by this connector only; the shell sends them once P's final output
   arrived with ``exported.complete``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from pdd.engine.connector_meta import PddConnectorMetadata
from pdd.engine.connector_params import ConnectorSettings
from pdd.engine.connector_scheduler import SchedulerHalf
from pdd.engine.connector_worker import WorkerHalf
from pdd.engine.kv_copy import HeadShard
from pdd.errors import ConfigError

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class PddConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        try:
            settings = ConnectorSettings.model_validate(ktc.kv_connector_extra_config)
        except ValueError as exc:
            raise ConfigError(f"bad PddConnector kv_connector_extra_config: {exc}") from exc
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError("PddConnector supports one KV cache group (full attention) only")
        self._sched: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            block_size = vllm_config.cache_config.block_size
            self._sched = SchedulerHalf(
                settings, block_size, ktc.is_kv_producer, ktc.is_kv_consumer
            )
        else:
            self._worker = WorkerHalf(
                settings, kv_cache_config.num_blocks, _head_shard(vllm_config)
            )

    # ==== worker side ========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Once per step; before the forward whenever this step has loads (sync loads).
        self._w().load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads ran in start_load_kv, before the forward

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None  # saves run once per step, in wait_for_save, over all layers

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._w().save(self._meta())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._w().take_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.close()

    # ==== scheduler side =====================================================================

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s().bind(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request)

    # ==== helpers ============================================================================

    def _meta(self) -> PddConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddConnectorMetadata)
        return meta

    def _w(self) -> WorkerHalf:
        assert self._worker is not None, "worker-side method called on the scheduler half"
        return self._worker

    def _s(self) -> SchedulerHalf:
        assert self._sched is not None, "scheduler-side method called on the worker half"
        return self._sched


def _head_shard(vllm_config: VllmConfig) -> HeadShard:
    """The KV heads this worker's rank holds (called in the worker, once vLLM's tensor-parallel
    group exists)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    total = vllm_config.model_config.get_total_num_kv_heads()
    world = get_tensor_model_parallel_world_size()
    return HeadShard.of_rank(get_tensor_model_parallel_rank(), world, total)
