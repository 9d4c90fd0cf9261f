"""Scheduler half of PddConnector: which blocks to export, which to load, when to free.

Runs in vLLM's scheduler (the engine-core process), on the engine-core thread; never does I/O.
It owns the per-request bookkeeping:

- producer: ``_exports[req_id]`` from the first allocation until ``request_finished``. Each
  step, the blocks that this step's forward completes become an ExportJob; the last job
  (prompt complete) seals the stream, counting the partial last block. ``request_finished``
  returns True (vLLM must not free the blocks) iff a job was ever emitted, because only then
  does the worker hold views of them; the worker reports the request in ``finished_sending``
  exactly once, when the stream is terminal or its lease ran out.
- consumer: ``_loads[req_id]`` from ``update_state_after_alloc`` (blocks allocated) until
  ``request_finished``. ``get_num_new_matched_tokens`` answers (n, True): n prompt tokens
  arrive asynchronously; vLLM parks the request in WAITING_FOR_REMOTE_KVS until the worker
  reports it in ``finished_recving`` (and ``failed_recving`` on failure: vLLM recomputes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from pdd.engine.connector_meta import (
    ExportJob,
    LoadJob,
    PddConnectorMetadata,
    PddWorkerMetadata,
)
from pdd.engine.connector_params import (
    ConnectorSettings,
    ExportParams,
    ExportResult,
    LoadParams,
    LoadResult,
    RequestKvParams,
    wrap,
)

log = logging.getLogger(__name__)


@dataclass
class _Export:
    request: Request
    params: ExportParams
    next_block: int = 0  # first stream block not yet handed to the worker
    emitted: bool = False  # some job reached the worker: it holds views of our blocks
    sealed: bool = False
    dead: bool = False  # cut short (preempted): no more jobs


@dataclass
class _Load:
    params: LoadParams
    job: LoadJob
    result: LoadResult | None = None


class SchedulerHalf:
    def __init__(
        self, settings: ConnectorSettings, block_size: int, producer: bool, consumer: bool
    ):
        self._settings = settings
        self._block_size = block_size
        self._producer = producer
        self._consumer = consumer
        self._block_ids_of = None  # set by bind(): req_id -> tuple of block-id lists
        self._exports: dict[str, _Export] = {}
        self._loads: dict[str, _Load] = {}
        self._probes: dict[str, int] = {}  # req_id -> local hit seen by the last match query
        self._new_loads: list[LoadJob] = []
        self._cancels: list[str] = []

    def bind(self, kv_cache_manager: Any) -> None:
        self._block_ids_of = kv_cache_manager.get_block_ids

    # --- consumer: how many tokens arrive from outside --------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        params = self._params(request)
        if params is None or params.load is None or request.request_id in self._loads:
            return 0, False  # a second query after a load started (preemption): recompute
        if not self._consumer:
            log.warning("request %s asks for a load on a producer-only engine", request.request_id)
            return 0, False
        available = min(params.load.num_tokens, request.num_prompt_tokens)
        if available <= num_computed:
            return 0, False
        self._probes[request.request_id] = num_computed
        return available - num_computed, True

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external: int) -> None:
        params = self._params(request)
        if params is None:
            return
        rid = request.request_id
        if params.export is not None and rid not in self._exports:
            if self._producer:
                self._exports[rid] = _Export(request, params.export)
            else:
                log.warning("request %s asks for an export on a consumer-only engine", rid)
        if params.load is not None and num_external > 0 and rid in self._probes:
            self._start_load(request, params.load, blocks.get_block_ids()[0], num_external)

    def _start_load(
        self, request: Request, params: LoadParams, block_ids: list[int], num_external: int
    ) -> None:
        rid = request.request_id
        local = self._probes.pop(rid)  # block-aligned: vLLM passes a block-aligned local hit
        end = local + num_external
        first = local // self._block_size
        last = -(-end // self._block_size)  # ceil: the partial last block is loaded too
        job = LoadJob(
            req_id=rid,
            transfer_id=params.transfer_id,
            first_block=first,
            block_ids=tuple(block_ids[first:last]),
            num_tokens=end,
            deadline_s=params.deadline_s or self._settings.load_deadline_s,
        )
        self._loads[rid] = _Load(params, job)
        self._new_loads.append(job)

    # --- per step: build the worker's work list ---------------------------------------------

    def build_meta(self, out: SchedulerOutput) -> PddConnectorMetadata:
        meta = PddConnectorMetadata(loads=self._new_loads, cancels=self._cancels)
        self._new_loads, self._cancels = [], []
        for rid in out.preempted_req_ids or ():
            self._cut_export(rid, meta)
        for rid, num_new in out.num_scheduled_tokens.items():
            export = self._exports.get(rid)
            if export is not None and not export.sealed and not export.dead:
                job = self._export_job(export, num_new)
                if job is not None:
                    meta.exports.append(job)
        return meta

    def _export_job(self, export: _Export, num_new: int) -> ExportJob | None:
        """The blocks complete after this step: all whole blocks, plus the tail at the end."""
        req = export.request
        prompt = req.num_prompt_tokens
        done = min(req.num_computed_tokens + num_new, prompt)  # num_computed: before this step
        sealing = done >= prompt
        end = -(-prompt // self._block_size) if sealing else done // self._block_size
        if end <= export.next_block and not sealing:
            return None
        block_ids = self._block_ids_of(req.request_id)[0]
        job = ExportJob(
            req_id=req.request_id,
            transfer_id=export.params.transfer_id,
            first_block=export.next_block,
            block_ids=tuple(block_ids[export.next_block : end]),
            open=not export.emitted,
            seal_num_tokens=prompt if sealing else None,
            lease_s=export.params.lease_s or self._settings.lease_s,
        )
        export.next_block, export.emitted, export.sealed = end, True, sealing
        return job

    def _cut_export(self, rid: str, meta: PddConnectorMetadata) -> None:
        """A preempted producer request loses its blocks: the worker stops reading them now."""
        export = self._exports.get(rid)
        if export is not None and export.emitted and not export.sealed and not export.dead:
            export.dead = True
            meta.cancels.append(rid)
            log.info("export of %s cut short by preemption", rid)

    # --- results from the worker and the end of a request -----------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, PddWorkerMetadata):
            return
        for rid, result in meta.loads.items():
            if rid in self._loads:
                self._loads[rid].result = result
        for sent in meta.sends:
            log.info("export %s of %s ended %s after %.3f s", sent.transfer_id, sent.req_id,
                     sent.state, sent.seconds)  # fmt: skip

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._probes.pop(rid, None)
        load = self._loads.pop(rid, None)
        export = self._exports.pop(rid, None)
        if export is not None and export.emitted:
            aborted = request.status == RequestStatus.FINISHED_ABORTED
            if aborted or not export.sealed:
                self._cancels.append(rid)
            result = ExportResult(
                transfer_id=export.params.transfer_id,
                num_tokens=request.num_prompt_tokens if export.sealed else 0,
                num_blocks=export.next_block,
                complete=export.sealed and not export.dead and not aborted,
            )
            return True, wrap(exported=result)
        if load is not None and load.result is not None:
            return False, wrap(loaded=load.result)
        return False, None

    def _params(self, request: Request) -> RequestKvParams | None:
        try:
            return RequestKvParams.parse(request.kv_transfer_params)
        except ValidationError as exc:
            log.warning("request %s: ignoring bad pdd kv_transfer_params: %s", request.request_id,
                        exc)  # fmt: skip
            return None
