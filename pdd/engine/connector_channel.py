"""The KV channel: the small interface between PddConnector and whatever moves KV blocks.

A channel carries *streams* of KV blocks, each named by a transfer id. The producer side
(``KvSink``, in P's worker process) is fed block views of vLLM's paged cache; the consumer side
(``KvSource``, in RLD's/MD's worker process) copies blocks into paged-cache block views. Both
speak raw buffers (one ``memoryview`` per layer per block), never torch or vLLM types, so that
pdd.transfer (UCX, TCP) and pdd.cache (the DRC host tier) can implement them.

One block on the wire = the concatenation, in ``KvLayout.layer_names`` order, of that block's
bytes in every layer (on CPU, per layer: [num_kv_heads, block_size, 2 * head_dim]).

Ownership: a view handed to ``KvSink.offer`` points into vLLM's paged cache. PddConnector keeps
the block allocated until the sink reports a terminal state for the stream or ``cancel``
returned; the sink must not touch a view after either. Streams end in exactly one of
DONE | FAILED | CANCELLED; the connector then calls ``release``.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdd.errors import ConfigError


class SendState(enum.StrEnum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (SendState.DONE, SendState.FAILED, SendState.CANCELLED)


@dataclass(frozen=True)
class KvLayout:
    """Shape of one engine's paged KV cache, as the channel sees it. Both ends must match."""

    layer_names: tuple[str, ...]
    layer_block_bytes: int  # bytes of one block in one layer
    block_size: int  # tokens per block
    dtype: str  # e.g. "torch.float32"
    block_shape: tuple[int, ...]  # one layer's block, e.g. (num_kv_heads, block_size, 2*head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (one wire block)."""
        return self.layer_block_bytes * len(self.layer_names)

    def to_json(self) -> dict[str, Any]:
        return {
            "layer_names": list(self.layer_names),
            "layer_block_bytes": self.layer_block_bytes,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "block_shape": list(self.block_shape),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KvLayout:
        return cls(
            layer_names=tuple(d["layer_names"]),
            layer_block_bytes=int(d["layer_block_bytes"]),
            block_size=int(d["block_size"]),
            dtype=str(d["dtype"]),
            block_shape=tuple(d["block_shape"]),
        )


BlockViews = Sequence[memoryview]  # one buffer per layer, in KvLayout.layer_names order


class KvSink(Protocol):
    """Producer end. Thread-safe; no method blocks for I/O (cancel waits at most one block)."""

    def open(self, transfer_id: str) -> None:
        """Start a stream. Raises TransferError if the id is in use."""

    def offer(self, transfer_id: str, block_index: int, block: BlockViews) -> None:
        """Queue block ``block_index`` of the stream (views stay valid until terminal)."""

    def seal(self, transfer_id: str, num_tokens: int) -> None:
        """No more blocks; the stream carries ``num_tokens`` tokens. DONE once all are out."""

    def poll(self, transfer_id: str) -> SendState:
        """Current state of an open stream. Raises KeyError for an unknown id."""

    def cancel(self, transfer_id: str) -> None:
        """Stop the stream. On return no view of it is read again. Idempotent."""

    def release(self, transfer_id: str) -> None:
        """Forget a terminal stream (its id may be reused)."""

    def close(self) -> None:
        """Cancel every stream and stop background threads."""


class KvSource(Protocol):
    """Consumer end. ``fetch`` blocks (call it from a loader thread, never the engine loop)."""

    def fetch(self, transfer_id: str, block_index: int, dst: BlockViews, deadline: float) -> None:
        """Copy one block into ``dst`` once it is available.

        ``deadline`` is a time.monotonic() value. Raises TransferTimeout past it,
        TransferCancelled / TransferError when the producer gave up, IntegrityError when the
        bytes do not fit ``dst``. After any raise ``dst`` may hold partial data.
        """

    def close(self) -> None:
        """Stop background work."""


_BUILTIN_KINDS = {"shm": "pdd.engine.connector_shm"}


def _channel_module(kind: str):
    name = _BUILTIN_KINDS.get(kind, kind)
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"unknown KV channel kind {kind!r}: {exc}") from exc


def make_sink(kind: str, options: dict[str, Any], layout: KvLayout) -> KvSink:
    """Build the producer end of channel ``kind`` (raises ConfigError)."""
    return _channel_module(kind).make_sink(options, layout)


def make_source(kind: str, options: dict[str, Any], layout: KvLayout) -> KvSource:
    """Build the consumer end of channel ``kind`` (raises ConfigError)."""
    return _channel_module(kind).make_source(options, layout)
