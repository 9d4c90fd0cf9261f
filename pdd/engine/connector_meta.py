"""Per-step messages between PddConnector's two halves (pickled by vLLM across processes).

Scheduler half -> worker half, once per engine step (``PddConnectorMetadata``):
    exports   blocks that this step's forward completes and the sink should send
    loads     async loads to start into freshly allocated blocks
    cancels   request ids whose export must stop now (abort, preemption)
Worker half -> scheduler half, once per step (``PddWorkerMetadata``): load and send outcomes,
which the scheduler half reports in the finished request's kv_transfer_params and logs.

Block indices: ``first_block`` is the index, within the request's prompt, of the first block
listed; ``block_ids`` are vLLM block ids (indices into dim 0 of every layer's KV tensor).

    prompt tokens  |0 ........ 31|32 ....... 63|64 .. 70|
    block index    |      0      |      1      |   2    |   <- stream block index
    vLLM block id  |     17      |      4      |   9    |   <- block_ids
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from pdd.engine.connector_params import LoadResult


@dataclass(frozen=True)
class ExportJob:
    """After this step's forward, offer ``block_ids`` as stream blocks first_block, ...."""

    req_id: str
    transfer_id: str
    first_block: int
    block_ids: tuple[int, ...]
    open: bool  # first job of the stream: open it before offering
    seal_num_tokens: int | None  # not None: the prompt is complete, seal with this many tokens
    lease_s: float  # max hold time of the blocks once the request finished


@dataclass(frozen=True)
class LoadJob:
    """Load stream blocks first_block, ... into ``block_ids`` (allocated, owned by vLLM)."""

    req_id: str
    transfer_id: str
    first_block: int
    block_ids: tuple[int, ...]
    num_tokens: int  # tokens covered once loaded (local prefix hit + external)
    deadline_s: float


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):
    exports: list[ExportJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SendOutcome:
    req_id: str
    transfer_id: str
    state: str  # SendState value, or "lease_expired"
    seconds: float  # from the first offer to the end


@dataclass
class PddWorkerMetadata(KVConnectorWorkerMetadata):
    loads: dict[str, LoadResult] = field(default_factory=dict)  # req_id -> result
    sends: list[SendOutcome] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PddWorkerMetadata)
        return PddWorkerMetadata({**self.loads, **other.loads}, self.sends + other.sends)
