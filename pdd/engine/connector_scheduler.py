"""Scheduler half of PddConnector: which blocks to copy to/from which slots, and when.

Runs in vLLM's scheduler (the engine-core process), on the engine-core thread; no I/O, no
bytes. Owns ``_reqs``: one record per request that carries pdd kv_transfer_params, from the
first time vLLM shows it to us until ``request_finished``. Params are checked once, against
the arena size and the prompt; a refused request runs as if it had none (vLLM computes) and
its result says why.

- export (producer): each step, the prompt blocks this step's forward completes (and, on the
  first step, those vLLM's prefix cache already held) become a save job, up to len(slots).
  ``request_finished`` never delays the free: the copies already ran.
- load (consumer): ``get_num_new_matched_tokens`` answers (n, False): n tokens are available
  *synchronously*, so vLLM schedules the request at once and runs ``start_load_kv`` before the
  forward; the load job copies blocks [local hit, end) from their slots. At least one prompt
  token is always left to compute (vLLM needs one to sample from). A request loads once: its
  slots are read in its first step only, so the shell may free them at its first token
  (``kv_run.stream_loading``); preempted and scheduled again, it computes what it lost.
- fence: in the first step scheduled after ``request_finished``, the worker posts it.
- progress: once every rank's copies of a step are reported (``update_connector_output``),
  an exporting request's progress word on the board gets the end of the blocks its slots hold.
  Posted here, not by a rank: with tensor parallelism a slot is whole only when every rank
  copied its heads into it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from pdd.cache.arena import FenceBoard
from pdd.engine.connector_meta import CopyJob, PddConnectorMetadata, PddWorkerMetadata
from pdd.engine.connector_params import (
    ConnectorSettings,
    ExportResult,
    FenceRef,
    LoadResult,
    RequestKvParams,
    wrap,
)

log = logging.getLogger(__name__)


@dataclass
class _Req:
    request: Request
    slots: tuple[int, ...]
    is_export: bool
    fence: FenceRef | None
    error: str | None = None
    first: int = 0  # export: slots[i] is block first + i (ExportParams.first_block)
    next_block: int = 0  # export: first block not yet handed to the worker
    local_hit: int = 0  # load: block-aligned local prefix hit seen by the last match query
    tokens: int = 1 << 62  # load: prompt tokens the slots hold (LoadParams.tokens)
    loaded: LoadResult | None = None


class SchedulerHalf:
    def __init__(
        self, settings: ConnectorSettings, block_size: int, producer: bool, consumer: bool
    ):
        self._num_slots = settings.arena.num_slots
        self._num_fences = settings.fences.num_slots if settings.fences is not None else 0
        self._block_size = block_size
        self._producer, self._consumer = producer, consumer
        self._block_ids_of = None  # set by bind(): req_id -> tuple of block-id lists
        self._reqs: dict[str, _Req] = {}
        self._new_loads: list[CopyJob] = []
        self._fences: list[tuple[int, int]] = []
        self._progress = FenceBoard.attach(settings.progress) if settings.progress else None

    def bind(self, kv_cache_manager: Any) -> None:
        self._block_ids_of = kv_cache_manager.get_block_ids

    # --- consumer: how many prompt tokens come from slots -----------------------------------

    def get_num_new_matched_tokens(self, request: Request, local_hit: int) -> tuple[int, bool]:
        rec = self._record(request)
        if rec is None or rec.is_export or rec.error is not None or rec.loaded is not None:
            return 0, False  # loaded once already: preempted and back, it computes
        rec.local_hit = local_hit
        end = min(len(rec.slots) * self._block_size, rec.tokens, request.num_tokens - 1)
        if end <= local_hit:
            return 0, False  # vLLM's own prefix cache already holds every slotted block
        return end - local_hit, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external: int) -> None:
        rec = self._record(request)
        if rec is None or rec.is_export or rec.error is not None or num_external == 0:
            return
        bs = self._block_size
        first, end = rec.local_hit // bs, rec.local_hit + num_external
        last = -(-end // bs)  # ceil: a last block cut short at num_tokens - 1 is copied whole
        block_ids = blocks.get_block_ids()[0]
        self._new_loads.append(
            CopyJob(request.request_id, tuple(block_ids[first:last]), rec.slots[first:last])
        )
        rec.loaded = LoadResult(num_blocks=last - first, first_block=first, num_tokens=end, ok=True)

    # --- per step: the worker's copy list ---------------------------------------------------

    def build_meta(self, out: SchedulerOutput) -> PddConnectorMetadata:
        meta = PddConnectorMetadata(loads=self._new_loads, fences=self._fences)
        self._new_loads, self._fences = [], []
        for rid, num_new in out.num_scheduled_tokens.items():
            rec = self._reqs.get(rid)
            if rec is not None and rec.is_export and rec.error is None:
                job = self._save_job(rec, num_new)
                if job is not None:
                    meta.saves.append(job)
        return meta

    def _save_job(self, rec: _Req, num_new: int) -> CopyJob | None:
        """The slotted blocks whole once this step ran (num_computed_tokens: before the step).

        ``[next_block, end)``, end = min(tokens computed after this step // block_size,
        first + slots); the export starts at ``first``.
        """
        req, bs = rec.request, self._block_size
        done = min(req.num_computed_tokens + num_new, req.num_prompt_tokens)
        first = rec.first
        whole = -(-done // bs) if done == req.num_prompt_tokens else done // bs  # tail: at the end
        end = min(whole, first + len(rec.slots))
        if end <= rec.next_block:
            return None
        block_ids = self._block_ids_of(req.request_id)[0]
        start, rec.next_block = rec.next_block, end
        slots = rec.slots[start - first : end - first]
        progress = (rec.fence.index, end) if rec.fence is not None else None
        return CopyJob(req.request_id, tuple(block_ids[start:end]), slots, progress)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, PddWorkerMetadata):
            return
        for rid, stat in meta.loads.items():
            rec = self._reqs.get(rid)
            if rec is not None and rec.loaded is not None:
                rec.loaded = rec.loaded.model_copy(update={"seconds": stat.seconds})
        for rid, stat in meta.saves.items():
            log.debug("export of %s: %d blocks copied in %.4f s", rid, stat.blocks, stat.seconds)
        if self._progress is not None:
            for index, end in meta.progress.items():
                self._progress.post(index, end)

    def close(self) -> None:
        """Unmap the progress board (the shell owns and unlinks it)."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    # --- the end of a request ---------------------------------------------------------------

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Never delays the free: every copy of this request has run (see the module doc).

        Also for a request aborted before vLLM ever showed it to us: its fence is still due.
        """
        rec = self._record(request)
        self._reqs.pop(request.request_id, None)
        if rec is None:
            return False, None
        if rec.fence is not None:
            self._fences.append((rec.fence.index, rec.fence.ticket))
        if rec.is_export:
            done = rec.next_block
            result = ExportResult(
                num_blocks=done,
                num_tokens=min(done * self._block_size, request.num_prompt_tokens),
                complete=rec.error is None and done == rec.first + len(rec.slots),
                error=rec.error,
            )
            return False, wrap(exported=result)
        loaded = rec.loaded or LoadResult(  # refused, or all in vLLM's prefix cache
            num_blocks=0,
            first_block=min(rec.local_hit // self._block_size, len(rec.slots)),
            num_tokens=rec.local_hit,
            ok=rec.error is None,
            error=rec.error,
        )
        return False, wrap(loaded=loaded)

    # --- params -----------------------------------------------------------------------------

    def _record(self, request: Request) -> _Req | None:
        """The request's record, made (and checked) the first time it is seen."""
        rid = request.request_id
        if rid in self._reqs:
            return self._reqs[rid]
        try:
            params = RequestKvParams.parse(request.kv_transfer_params)
        except ValidationError as exc:
            log.warning("request %s: ignoring bad pdd kv_transfer_params: %s", rid, exc)
            return None
        if params is None or (params.export is None and params.load is None):
            return None
        p = params.export or params.load
        rec = _Req(request, tuple(p.slots), params.export is not None, p.fence)
        if params.export is not None:
            rec.first = rec.next_block = params.export.first_block
        elif params.load is not None and params.load.tokens is not None:
            rec.tokens = params.load.tokens
        rec.error = self._refusal(request, params)
        if rec.error is not None:
            log.warning("request %s: pdd KV params refused: %s", rid, rec.error)
            if rec.fence is not None and rec.fence.index >= self._num_fences:
                rec.fence = None  # cannot post it; the shell learns why from the result
        self._reqs[rid] = rec
        return rec

    def _refusal(self, request: Request, params: RequestKvParams) -> str | None:
        """Why these params cannot be served, or None."""
        if params.export is not None and params.load is not None:
            return "a request may export or load, not both"
        p = params.export or params.load
        if params.export is not None and not self._producer:
            return "export asked of an engine that is not a kv_producer"
        if params.load is not None and not self._consumer:
            return "load asked of an engine that is not a kv_consumer"
        if max(p.slots) >= self._num_slots:
            return f"slot {max(p.slots)} out of range: the arena has {self._num_slots} slots"
        blocks = -(-request.num_prompt_tokens // self._block_size)  # the last may be cut short
        first = params.export.first_block if params.export is not None else 0
        if first + len(p.slots) > blocks:
            after = f" from block {first}" if first else ""
            return (
                f"{len(p.slots)} slots{after} but the prompt ({request.num_prompt_tokens} "
                f"tokens) has only {blocks} blocks of {self._block_size} tokens"
            )
        tokens = params.load.tokens if params.load is not None else None
        held = len(p.slots) * self._block_size
        if tokens is not None and not held - self._block_size < tokens <= held:
            return f"{tokens} tokens do not end in the last of {len(p.slots)} slots"
        if p.fence is not None and p.fence.index >= self._num_fences:
            return f"fence index {p.fence.index} out of range: the board has {self._num_fences}"
        return None
