"""Chunk fault injection on a sending transport (tests only; ``worker.faults.kv_send``).

Every transport calls ``FaultHooks.corrupt(header)`` on its sender thread for each chunk it is
about to put on the wire (``tcp_send``, ``ucx``, ``inproc``); ``ChunkFaults.hooks()`` returns
hooks whose callback executes the configured rules there, so no transport needs to know about
them:

    corrupt   return True: the transport flips one payload byte; the receiver's checksum of
              the source bytes no longer matches and the chunk (and its transfer) is refused
    delay     sleep ``delay_s`` on the sender thread, then send the chunk intact
    drop      hold the sender thread until the transfer's deadline passed (or the transport
              closes): the chunk never arrives and both ends fail the transfer at their
              deadline, as on a black-holed link
    truncate  raise TransferError: the sender breaks the connection at this chunk and the
              transfer ends short (FAILED on both ends)

``on_chunk`` (optional) sees every chunk first; the worker uses it to exit at its N-th chunk.
Lifecycle: one ``ChunkFaults`` per transport; ``release()`` wakes held senders (call it before
closing the transport so ``close`` does not wait for a drop to time out).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Sequence

from pdd.config.faults import KvChunkFault
from pdd.errors import TransferError
from pdd.transfer.api import FaultHooks
from pdd.transfer.wire import ChunkHeader

log = logging.getLogger(__name__)

DROP_HOLD_CAP_S = 600.0  # a drop never holds a sender longer than this


class ChunkFaults:
    """The ``kv_send`` rules of one worker, for its transport of kind ``kind``."""

    def __init__(
        self,
        kind: str,
        rules: Sequence[KvChunkFault],
        deadline_s: float,
        on_chunk: Callable[[ChunkHeader], None] | None = None,
    ):
        self.kind = kind
        self._rules = [r for r in rules if r.transport in ("any", kind)]
        self._rngs = [random.Random(r.seed) for r in self._rules]
        self._deadline_s = deadline_s
        self._on_chunk = on_chunk
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.injected: dict[str, int] = {}  # action -> chunks it hit (tests read it)

    @property
    def active(self) -> bool:
        return bool(self._rules) or self._on_chunk is not None

    def hooks(self) -> FaultHooks:
        return FaultHooks(corrupt=self._on_wire)

    def release(self) -> None:
        """Wake every sender a drop holds (the transport is closing)."""
        self._released.set()

    def _on_wire(self, header: ChunkHeader) -> bool:
        """Called by the transport's sender thread; True: flip one byte of this chunk."""
        if self._on_chunk is not None:
            self._on_chunk(header)
        corrupt = False
        for rule, rng in zip(self._rules, self._rngs, strict=True):
            if not self._matches(rule, rng, header):
                continue
            self._count(rule.action, header)
            if rule.action == "corrupt":
                corrupt = True
            elif rule.action == "delay":
                self._released.wait(rule.delay_s)
            elif rule.action == "drop":
                hold = header.deadline_ms / 1000 if header.deadline_ms else self._deadline_s
                self._released.wait(min(hold + 1.0, DROP_HOLD_CAP_S))
                raise TransferError(f"fault injection: chunk {header.chunk_index} dropped")
            else:
                raise TransferError(f"fault injection: cut at chunk {header.chunk_index}")
        return corrupt

    def _matches(self, rule: KvChunkFault, rng: random.Random, header: ChunkHeader) -> bool:
        if rule.chunks and header.chunk_index not in rule.chunks:
            return False
        if header.total_bytes < rule.min_bytes:
            return False
        if rule.max_bytes is not None and header.total_bytes > rule.max_bytes:
            return False
        with self._lock:
            return rule.probability >= 1.0 or rng.random() < rule.probability

    def _count(self, action: str, header: ChunkHeader) -> None:
        with self._lock:
            self.injected[action] = self.injected.get(action, 0) + 1
        log.warning(
            "fault injection (%s): %s chunk %d/%d of KV request %s (%d bytes in the transfer)",
            self.kind, action, header.chunk_index, header.chunk_count, header.request_id,
            header.total_bytes,
        )  # fmt: skip
