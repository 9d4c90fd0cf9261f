"""Fault injection in the worker shell (tests only): ``worker.faults`` of pdd/config/faults.py.

Owns, for one worker process:

- the hard exit (``hard_exit``): SIGKILL the process's own children first (the vLLM engine
  core: a worker killed alone would leave a ``VLLM::EngineCore`` orphan holding its memory),
  then ``os._exit(FAULT_EXIT_CODE)`` with no cleanup at all, as a crash would. Shared-memory
  arenas are left behind; the next worker start removes them (``arena.unlink_stale``);
- ``kill_after_tokens``: ``TokenKill`` per Generate stream (``stream_kill``), checked by the
  service before each response goes out;
- ``kill_at_kv_chunk`` and the ``kv_send`` chunk rules: ``transport_faults(kind)`` gives the
  KV plane the ``FaultHooks`` for a transport (pdd.transfer.faulty executes the rules).

Everything is off unless the worker's config has a ``faults`` section; ``WorkerFaults.of``
logs a warning naming what is on, once per process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import psutil

from pdd.config import WorkerConfig
from pdd.config.faults import FaultsConfig
from pdd.transfer.faulty import ChunkFaults
from pdd.transfer.wire import ChunkHeader

log = logging.getLogger(__name__)

FAULT_EXIT_CODE = 86  # a worker that exited by fault injection (distinct from errors: 1, 2)

_instances: dict[str, WorkerFaults] = {}
_instances_lock = threading.Lock()


def hard_exit(reason: str) -> None:
    """Die now, like a crash: kill our children (the engine core), then ``os._exit``."""
    log.error("fault injection: exiting hard (%s)", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    os._exit(FAULT_EXIT_CODE)


class TokenKill:
    """One Generate stream's count toward ``kill_after_tokens``."""

    def __init__(self, limit: int, request_id: str):
        self._limit = limit
        self._request_id = request_id
        self._sent = 0

    def before_send(self, n_tokens: int) -> None:
        """Called before a response with ``n_tokens`` goes out; exits instead of sending
        more than ``limit`` tokens (so exactly ``limit`` went out before the death)."""
        if self._sent + n_tokens > self._limit or self._limit == 0:
            hard_exit(f"kill_after_tokens={self._limit} reached on request {self._request_id}")
        self._sent += n_tokens


class WorkerFaults:
    """The faults of one worker process. Build with ``WorkerFaults.of(worker)``."""

    def __init__(self, worker_id: str, cfg: FaultsConfig):
        self.worker_id = worker_id
        self.cfg = cfg
        self._chunks_seen = 0
        self._lock = threading.Lock()
        self._transports: list[ChunkFaults] = []

    @classmethod
    def of(cls, worker: WorkerConfig) -> WorkerFaults | None:
        """The worker's faults (one object per worker id in this process), None when off."""
        if not worker.faults.enabled:
            return None
        with _instances_lock:
            found = _instances.get(worker.id)
            if found is None:
                found = _instances[worker.id] = cls(worker.id, worker.faults)
                log.warning(
                    "FAULT INJECTION IS ON for worker %s (tests only): %s",
                    worker.id, worker.faults.model_dump_json(exclude_defaults=True),
                )  # fmt: skip
        return found

    def stream_kill(self, request_id: str) -> TokenKill | None:
        limit = self.cfg.kill_after_tokens
        return None if limit is None else TokenKill(limit, request_id)

    def transport_faults(self, kind: str, deadline_s: float) -> ChunkFaults | None:
        """Chunk faults for this worker's transport of ``kind`` (None: nothing applies)."""
        on_chunk = self._count_chunk if self.cfg.kill_at_kv_chunk is not None else None
        faults = ChunkFaults(kind, self.cfg.kv_send, deadline_s, on_chunk)
        if not faults.active:
            return None
        self._transports.append(faults)
        return faults

    def release(self) -> None:
        """Wake senders held by drop rules (the transports are closing)."""
        for faults in self._transports:
            faults.release()

    def _count_chunk(self, header: ChunkHeader) -> None:
        with self._lock:
            self._chunks_seen += 1
            n = self._chunks_seen
        if n >= (self.cfg.kill_at_kv_chunk or 0):
            hard_exit(f"kill_at_kv_chunk={n} (chunk {header.chunk_index} of {header.request_id})")
