"""pdd.transfer: moves KV blocks between processes (UCX inside a datacenter, TCP across the WAN).

Owns the transfer interface (`api`), the wire format (`wire`), the bookkeeping of pins and lent
buffers (`ledger`) and three transports behind one contract: `inproc` (tests), `tcp` (WAN:
parallel streams, chunk pipelining, integrity, deadlines, cancel, optional mutual TLS, live link
estimates) and `ucx` (ucxx: shared memory on one host, TCP or RDMA elsewhere). Never imports
torch or vLLM; the KV connector in pdd.engine hands it host buffers.
"""

from __future__ import annotations

from collections.abc import Callable

from pdd.config.transfer import TransferConfig
from pdd.errors import ConfigError
from pdd.transfer.api import (
    FaultHooks,
    InboundResult,
    KVSegment,
    LinkEstimate,
    PeerAddress,
    ReceiverHooks,
    SendRequest,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
    TransportStats,
)
from pdd.transfer.wire import ChunkHeader

KINDS = ("inproc", "tcp", "ucx")

__all__ = [
    "KINDS",
    "ChunkHeader",
    "FaultHooks",
    "InboundResult",
    "KVSegment",
    "LinkEstimate",
    "PeerAddress",
    "ReceiverHooks",
    "SendRequest",
    "TransferHandle",
    "TransferState",
    "TransferStatus",
    "Transport",
    "TransportStats",
    "create_transport",
]


def create_transport(
    kind: str,
    config: TransferConfig | None = None,
    hooks: ReceiverHooks | None = None,
    faults: FaultHooks | None = None,
    on_finished: Callable[[TransferStatus], None] | None = None,
) -> Transport:
    """Build (not start) a transport of `kind`; give `hooks` to make it receive."""
    if kind == "inproc":
        from pdd.transfer.inproc import InprocTransport as cls
    elif kind == "tcp":
        from pdd.transfer.tcp import TcpTransport as cls
    elif kind == "ucx":
        from pdd.transfer.ucx import UcxTransport as cls
    else:
        raise ConfigError(f"unknown transport kind {kind!r} (have {', '.join(KINDS)})")
    return cls(config, hooks=hooks, faults=faults, on_finished=on_finished)
