"""A KV channel through a shared directory (``/dev/shm`` on one host): tests and prototypes.

Store-and-forward: the sink copies each offered block into a file, so a stream is DONE (and
P's blocks can be freed) once every block and the seal are written; any number of consumers
may read it afterwards. Files of a stream ``T`` under ``root``:

    T/layout.json    KvLayout of the producer (written by open)
    T/b000007        block 7: every layer's bytes, layer order (tmp file + rename: atomic)
    T/sealed.json    {"num_tokens", "num_blocks", "bytes", "opened_at", "sealed_at"}
    T/cancelled      the producer gave up (cancel or failure); consumers stop waiting

Nothing is deleted: the owner of ``root`` removes it (the test's tmp dir). The source waits
for files by polling with a short back-off: acceptable for this test channel only; real
transports (pdd.transfer) notify.

Options: ``{"root": "/dev/shm/some-dir"}`` (required).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdd.engine.connector_channel import BlockViews, KvLayout, SendState
from pdd.errors import (
    ConfigError,
    IntegrityError,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)

log = logging.getLogger(__name__)


def _root(options: dict[str, Any]) -> Path:
    root = options.get("root")
    if not root:
        raise ConfigError("shm KV channel needs options.root")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_atomic(path: Path, chunks: BlockViews | list[bytes]) -> int:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        n = sum(f.write(c) for c in chunks)
    os.replace(tmp, path)
    return n


@dataclass
class _Stream:
    state: SendState
    opened_at: float
    num_blocks: int = 0
    bytes: int = 0


class ShmSink:
    """KvSink writing into ``root``. One writer thread; see the module doc for the files."""

    def __init__(self, root: Path, layout: KvLayout) -> None:
        self._root = root
        self._layout = layout
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams; held while one block is written
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pdd-kv-shm-sink", daemon=True)
        self._thread.start()

    def open(self, transfer_id: str) -> None:
        with self._lock:
            if transfer_id in self._streams:
                raise TransferError(f"transfer {transfer_id!r} is already open")
            self._streams[transfer_id] = _Stream(SendState.PENDING, time.time())
        self._queue.put(("open", transfer_id, None, None))

    def offer(self, transfer_id: str, block_index: int, block: BlockViews) -> None:
        self._queue.put(("block", transfer_id, block_index, block))

    def seal(self, transfer_id: str, num_tokens: int) -> None:
        self._queue.put(("seal", transfer_id, num_tokens, None))

    def poll(self, transfer_id: str) -> SendState:
        with self._lock:
            return self._streams[transfer_id].state

    def cancel(self, transfer_id: str) -> None:
        with self._lock:  # waits for a block write in progress: then no view is read again
            stream = self._streams.get(transfer_id)
            if stream is None or stream.state.terminal:
                return
            stream.state = SendState.CANCELLED
        self._mark_cancelled(transfer_id)

    def release(self, transfer_id: str) -> None:
        with self._lock:
            self._streams.pop(transfer_id, None)

    def close(self) -> None:
        with self._lock:
            open_ids = [t for t, s in self._streams.items() if not s.state.terminal]
        for transfer_id in open_ids:
            self.cancel(transfer_id)
        self._queue.put(None)
        self._thread.join(timeout=10)

    # --- writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            op, transfer_id, arg, block = item
            with self._lock:
                stream = self._streams.get(transfer_id)
                if stream is None or stream.state.terminal:
                    continue  # cancelled: drop its queued work, never read its views
                try:
                    self._apply(op, transfer_id, stream, arg, block)
                except OSError as exc:
                    log.warning("shm sink: transfer %s failed: %s", transfer_id, exc)
                    stream.state = SendState.FAILED
            if stream.state is SendState.FAILED:
                self._mark_cancelled(transfer_id)

    def _apply(self, op: str, transfer_id: str, stream: _Stream, arg: Any, block: Any) -> None:
        folder = self._root / transfer_id
        if op == "open":
            folder.mkdir(exist_ok=False)
            body = json.dumps(self._layout.to_json()).encode()
            _write_atomic(folder / "layout.json", [body])
            stream.state = SendState.TRANSFERRING
        elif op == "block":
            stream.bytes += _write_atomic(folder / f"b{arg:06d}", block)
            stream.num_blocks = max(stream.num_blocks, arg + 1)
        elif op == "seal":
            seal = {
                "num_tokens": arg,
                "num_blocks": stream.num_blocks,
                "bytes": stream.bytes,
                "opened_at": stream.opened_at,
                "sealed_at": time.time(),
            }
            _write_atomic(folder / "sealed.json", [json.dumps(seal).encode()])
            stream.state = SendState.DONE

    def _mark_cancelled(self, transfer_id: str) -> None:
        folder = self._root / transfer_id
        try:
            folder.mkdir(exist_ok=True)
            (folder / "cancelled").touch()
        except OSError as exc:  # consumers then time out instead of failing fast
            log.warning("shm sink: cannot mark %s cancelled: %s", transfer_id, exc)


class ShmSource:
    """KvSource reading from ``root``; waits for block files with a short polling back-off."""

    def __init__(self, root: Path, layout: KvLayout) -> None:
        self._root = root
        self._layout = layout
        self._checked: set[str] = set()  # transfer ids whose layout matched ours

    def fetch(self, transfer_id: str, block_index: int, dst: BlockViews, deadline: float) -> None:
        folder = self._root / transfer_id
        path = folder / f"b{block_index:06d}"
        pause = 0.0005
        while True:
            if (folder / "cancelled").exists():
                raise TransferCancelled(f"transfer {transfer_id} was cancelled by its producer")
            if path.exists() and self._layout_ok(transfer_id, folder):
                self._read_block(path, dst)
                return
            sealed = folder / "sealed.json"
            if sealed.exists() and block_index >= json.loads(sealed.read_bytes())["num_blocks"]:
                raise TransferError(f"transfer {transfer_id} has no block {block_index}")
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"transfer {transfer_id} block {block_index}: deadline")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def _layout_ok(self, transfer_id: str, folder: Path) -> bool:
        if transfer_id in self._checked:
            return True
        theirs = KvLayout.from_json(json.loads((folder / "layout.json").read_bytes()))
        if theirs != self._layout:
            raise IntegrityError(f"transfer {transfer_id}: producer layout {theirs} != ours")
        self._checked.add(transfer_id)
        return True

    @staticmethod
    def _read_block(path: Path, dst: BlockViews) -> None:
        with open(path, "rb") as f:
            for view in dst:
                if f.readinto(view) != len(view):
                    raise IntegrityError(f"{path}: short block")
            if f.read(1):
                raise IntegrityError(f"{path}: block larger than the consumer's")

    def close(self) -> None:
        return None


def make_sink(options: dict[str, Any], layout: KvLayout) -> ShmSink:
    return ShmSink(_root(options), layout)


def make_source(options: dict[str, Any], layout: KvLayout) -> ShmSource:
    return ShmSource(_root(options), layout)
