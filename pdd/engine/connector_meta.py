"""Per-step messages between PddConnector's two halves (pickled by vLLM across processes).

Scheduler half -> worker half, once per engine step (``PddConnectorMetadata``):
    loads    copy slots -> paged blocks, before this step's forward (it reads them)
    saves    copy paged blocks -> slots, after this step's forward (it computed them)
    fences   (index, ticket) to post: those requests finished before this step was scheduled,
             so no step that copies for them is still to run once this step runs
A save job with ``progress`` (index, end) posts ``end`` to the progress board's word ``index``
once its copy ran: the request's slots then hold its prompt blocks up to ``end``.
Worker half -> scheduler half, once per step (``PddWorkerMetadata``): copy counts and times.

One CopyJob pairs vLLM block ids with arena slots, position by position:

    prompt block index   |  0  |  1  |  2  |      (tokens [32 i, 32 i + 32) at block_size 32)
    block_ids (vLLM)     | 17  |  4  |  9  |      indices into dim 0 of every layer's KV tensor
    slots (arena)        |  9  |  8  |  7  |      indices into the shell's arena
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class CopyJob:
    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]  # same length as block_ids
    progress: tuple[int, int] | None = None  # save: (board index, end block) to post after it


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):
    loads: list[CopyJob] = field(default_factory=list)
    saves: list[CopyJob] = field(default_factory=list)
    fences: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class CopyStat:
    blocks: int
    seconds: float

    def __add__(self, other: CopyStat) -> CopyStat:
        return CopyStat(self.blocks + other.blocks, self.seconds + other.seconds)


@dataclass
class PddWorkerMetadata(KVConnectorWorkerMetadata):
    loads: dict[str, CopyStat] = field(default_factory=dict)  # req_id -> this step's loads
    saves: dict[str, CopyStat] = field(default_factory=dict)  # req_id -> this step's saves

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PddWorkerMetadata)
        return PddWorkerMetadata(_merge(self.loads, other.loads), _merge(self.saves, other.saves))


def _merge(a: dict[str, CopyStat], b: dict[str, CopyStat]) -> dict[str, CopyStat]:
    out = dict(a)
    for rid, stat in b.items():
        out[rid] = out[rid] + stat if rid in out else stat
    return out
