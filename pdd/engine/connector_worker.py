"""Worker half of PddConnector: moves block bytes between vLLM's paged KV cache and the channel.

Runs in vLLM's worker process (with ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` a separate process
from the scheduler; see docs/notes/vllm-connector.md), on the model-runner thread, plus one
loader thread of its own. Owns:

- ``PagedKv``: per-layer byte views of the paged cache (block id -> one memoryview per layer).
- the sink (producer) and its open streams ``_sends`` (req_id -> _Send). A stream is created by
  the first ExportJob and removed exactly once, when it is reported in ``finished_sending``:
  after the request finished AND (the sink says terminal OR its lease expired -> cancel).
- the source (consumer) and the ``Loader`` thread. Every LoadJob ends in exactly one
  LoadResult, reported in ``finished_recving`` (and ``failed_recving`` if not ok).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from pdd.engine.connector_channel import (
    KvLayout,
    KvSink,
    KvSource,
    SendState,
    make_sink,
    make_source,
)
from pdd.engine.connector_meta import (
    ExportJob,
    LoadJob,
    PddConnectorMetadata,
    PddWorkerMetadata,
    SendOutcome,
)
from pdd.engine.connector_params import ConnectorSettings, LoadResult
from pdd.errors import TransferCancelled, TransferError

log = logging.getLogger(__name__)


class PagedKv:
    """Byte views of vLLM's per-layer KV tensors, [num_blocks, layer_block_bytes] each.

    CPU layout per layer: [num_blocks, num_kv_heads, block_size, 2 * head_dim], contiguous, so
    one block of one layer is one contiguous run of bytes (K rows then V rows per head).
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        first = next(iter(kv_caches.values()))
        for name, t in kv_caches.items():
            if not t.is_contiguous() or t.shape != first.shape or t.dtype != first.dtype:
                raise TransferError(f"KV layer {name}: unsupported layout {tuple(t.shape)}")
        self.layout = KvLayout(
            layer_names=tuple(kv_caches),
            layer_block_bytes=first[0].numel() * first.element_size(),
            block_size=block_size,
            dtype=str(first.dtype),
            block_shape=tuple(first.shape[1:]),
        )
        # uint8 views share memory with the tensors: writes land in the paged cache.
        self._layers = [
            t.view(torch.uint8).view(t.shape[0], -1).numpy() for t in kv_caches.values()
        ]

    def block(self, block_id: int) -> list[memoryview]:
        return [memoryview(layer[block_id]) for layer in self._layers]


@dataclass
class _Send:
    job: ExportJob  # the opening job (transfer id, lease)
    started: float
    lease_deadline: float | None = None  # set when the request finished


class Loader:
    """One thread running LoadJobs in order; results are drained with ``take_results``."""

    def __init__(self, source: KvSource, kv: PagedKv) -> None:
        self._source, self._kv = source, kv
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _cancelled (read by the thread between blocks)
        self._cancelled: set[str] = set()
        self._pending: set[str] = set()  # engine thread only
        self._thread = threading.Thread(target=self._run, name="pdd-kv-loader", daemon=True)
        self._thread.start()

    def submit(self, job: LoadJob) -> None:
        self._pending.add(job.req_id)
        self._jobs.put(job)

    def cancel(self, req_id: str) -> None:
        if req_id in self._pending:
            with self._lock:
                self._cancelled.add(req_id)

    def take_results(self) -> list[tuple[str, LoadResult]]:
        out = []
        while not self._results.empty():
            rid, result = self._results.get()
            self._pending.discard(rid)
            with self._lock:
                self._cancelled.discard(rid)
            out.append((rid, result))
        return out

    def close(self) -> None:
        with self._lock:
            self._cancelled.update(self._pending)
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            started = time.monotonic()
            error = self._load(job, started + job.deadline_s)
            result = LoadResult(
                transfer_id=job.transfer_id,
                num_tokens=job.num_tokens,
                num_blocks=len(job.block_ids),
                ok=error is None,
                seconds=time.monotonic() - started,
                error=error,
            )
            self._results.put((job.req_id, result))

    def _load(self, job: LoadJob, deadline: float) -> str | None:
        """Copy every block of the job; the error text, or None when all landed."""
        try:
            for i, block_id in enumerate(job.block_ids):
                with self._lock:
                    cancelled = job.req_id in self._cancelled
                if cancelled:
                    raise TransferCancelled(f"load of {job.req_id} cancelled")
                dst = self._kv.block(block_id)
                self._source.fetch(job.transfer_id, job.first_block + i, dst, deadline)
        except TransferError as exc:
            log.warning("load %s of %s failed: %s", job.transfer_id, job.req_id, exc)
            return f"{type(exc).__name__}: {exc.message}"
        return None


class WorkerHalf:
    def __init__(
        self, settings: ConnectorSettings, block_size: int, producer: bool, consumer: bool
    ):
        self._settings = settings
        self._block_size = block_size
        self._producer, self._consumer = producer, consumer
        self._kv: PagedKv | None = None
        self._sink: KvSink | None = None
        self._loader: Loader | None = None
        self._sends: dict[str, _Send] = {}
        self._finished: set[str] = set()  # finished req ids we may still have to report
        self._out = PddWorkerMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = PagedKv(kv_caches, self._block_size)
        ch = self._settings.channel
        if self._producer:
            self._sink = make_sink(ch.kind, ch.options, self._kv.layout)
        if self._consumer:
            self._loader = Loader(make_source(ch.kind, ch.options, self._kv.layout), self._kv)

    # --- called by the model runner each step -----------------------------------------------

    def apply_cancels(self, meta: PddConnectorMetadata) -> None:
        """Before the forward: stop reading blocks vLLM is about to reuse (idempotent)."""
        for rid in meta.cancels:
            send = self._sends.get(rid)
            if send is not None and self._sink is not None:
                self._sink.cancel(send.job.transfer_id)

    def start_loads(self, meta: PddConnectorMetadata) -> None:
        for job in meta.loads:
            if self._loader is None:
                raise TransferError("load requested on an engine without a consumer role")
            self._loader.submit(job)

    def export(self, meta: PddConnectorMetadata) -> None:
        """After the forward: offer the blocks it completed. Queues only; never waits on I/O."""
        for job in meta.exports:
            assert self._sink is not None and self._kv is not None
            if job.open:
                self._sink.open(job.transfer_id)
                self._sends[job.req_id] = _Send(job, time.monotonic())
            elif job.req_id not in self._sends:
                continue
            for i, block_id in enumerate(job.block_ids):
                self._sink.offer(job.transfer_id, job.first_block + i, self._kv.block(block_id))
            if job.seal_num_tokens is not None:
                self._sink.seal(job.transfer_id, job.seal_num_tokens)

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults()
        now = time.monotonic()
        for rid in finished_req_ids:
            if rid in self._sends:
                send = self._sends[rid]
                send.lease_deadline = now + send.job.lease_s
                self._finished.add(rid)
            if self._loader is not None:
                self._loader.cancel(rid)
        for rid in list(self._finished):
            state = self._end_state(self._sends[rid], now)
            if state is not None:
                res.finished_sending.add(rid)
                self._report_send(rid, state, now)
        if self._loader is not None:
            for rid, result in self._loader.take_results():
                res.finished_recving.add(rid)
                if not result.ok:
                    res.failed_recving.add(rid)
                self._out.loads[rid] = result
        return res

    def _end_state(self, send: _Send, now: float) -> str | None:
        assert self._sink is not None and send.lease_deadline is not None
        state = self._sink.poll(send.job.transfer_id)
        if state.terminal:
            return state.value
        if now >= send.lease_deadline:
            self._sink.cancel(send.job.transfer_id)  # on return the sink reads no more views
            return "lease_expired"
        return None

    def _report_send(self, rid: str, state: str, now: float) -> None:
        send = self._sends.pop(rid)
        self._finished.discard(rid)
        assert self._sink is not None
        self._sink.release(send.job.transfer_id)
        self._out.sends.append(SendOutcome(rid, send.job.transfer_id, state, now - send.started))
        if state != SendState.DONE.value:
            log.warning("export %s of %s ended %s", send.job.transfer_id, rid, state)

    def take_worker_meta(self) -> PddWorkerMetadata | None:
        if not self._out.loads and not self._out.sends:
            return None
        out, self._out = self._out, PddWorkerMetadata()
        return out

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close()
        if self._sink is not None:
            self._sink.close()
