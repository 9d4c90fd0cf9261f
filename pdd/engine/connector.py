"""PddConnector: pdd's vLLM KV connector (``KVConnectorBase_V1``, vLLM 0.32).

vLLM builds two instances per engine from ``KVTransferConfig(kv_connector="PddConnector",
kv_connector_module_path="pdd.engine.connector", kv_role=..., kv_connector_extra_config=...)``:
one with role SCHEDULER (in the engine-core process) and one with role WORKER (in the worker
process: the same process when the executor is "uni", a child of it when "mp"). This class
only dispatches to the half for its role:

- ``SchedulerHalf`` (connector_scheduler.py): per-request bookkeeping, no I/O.
- ``WorkerHalf`` (connector_worker.py): copies blocks between the paged cache and a KV channel.

Per request, in ``kv_transfer_params["pdd"]`` (typed in connector_params.py):
- ``export`` (kv_producer): stream the prompt's KV blocks into the channel as soon as each
  forward completes them; vLLM keeps the blocks until the stream ends (done, failed,
  cancelled, lease expired). The finished output carries ``exported``.
- ``load`` (kv_consumer): load the first ``num_tokens`` prompt tokens from the channel
  asynchronously, then compute the rest (the last prompt token, or the extend tokens). A failed
  load makes vLLM recompute. The finished output carries ``loaded``.

The channel (connector_channel.py) is pluggable: ``extra_config["channel"]``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from pdd.engine.connector_meta import PddConnectorMetadata
from pdd.engine.connector_params import ConnectorSettings
from pdd.engine.connector_scheduler import SchedulerHalf
from pdd.engine.connector_worker import WorkerHalf
from pdd.errors import ConfigError

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


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
        block_size = vllm_config.cache_config.block_size
        producer, consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        self._sched: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._require_recompute_policy(consumer)
            self._sched = SchedulerHalf(settings, block_size, producer, consumer)
        else:
            self._worker = WorkerHalf(settings, block_size, producer, consumer)

    def _require_recompute_policy(self, consumer: bool) -> None:
        """A failed load must be recomputed, never fail the user's request (vLLM's default).

        vLLM's scheduler reads kv_load_failure_policy right after building this half, so the
        setting made here takes effect; pdd.engine.engine should pass it explicitly anyway.
        """
        ktc = self._kv_transfer_config
        if consumer and ktc.kv_load_failure_policy != "recompute":
            log.warning("PddConnector: setting kv_load_failure_policy='recompute' (was %r)",
                        ktc.kv_load_failure_policy)  # fmt: skip
            ktc.kv_load_failure_policy = "recompute"

    # ==== worker side ========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, PddConnectorMetadata)
        self._w().apply_cancels(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        self._w().apply_cancels(meta)  # also on steps without a forward
        self._w().start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole-request and async: vLLM schedules only after they end

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None  # exports run once per step, in wait_for_save, over all layers

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._w().export(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._w().transfer_results(finished_req_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._w().take_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

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
