"""Per-step messages between PddConnector's two halves (pickled by vLLM across processes).

Scheduler half -> worker half, once per engine step (``PddConnectorMetadata``):
    loads    copy slots -> paged blocks, before this step's forward (it reads them)
    saves    copy paged blocks -> slots, after this step's forward (it computed them)
    fences   (index, ticket) to post: those requests finished before this step was scheduled,
             so no step that copies for them is still to run once this step runs
A save job with ``progress`` (index, end) reports it back once its copy ran; the scheduler half
posts ``end`` to the progress board's word ``index`` when every rank's report of the step is in
(vLLM aggregates them): the request's slots then hold its prompt blocks up to ``end``.
Worker half -> scheduler half, once per step (``PddWorkerMetadata``): copy counts and times,
and the progress the step's saves reached. With tensor parallelism each rank copies its own KV
heads of the same blocks in parallel, so the aggregate is the slowest rank's figures.

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
        """Two copies one after the other (one rank, one step)."""
        return CopyStat(self.blocks + other.blocks, self.seconds + other.seconds)

    def slowest(self, other: CopyStat) -> CopyStat:
        """Two ranks' copies of the same blocks, in parallel."""
        return CopyStat(max(self.blocks, other.blocks), max(self.seconds, other.seconds))


@dataclass
class PddWorkerMetadata(KVConnectorWorkerMetadata):
    loads: dict[str, CopyStat] = field(default_factory=dict)  # req_id -> this step's loads
    saves: dict[str, CopyStat] = field(default_factory=dict)  # req_id -> this step's saves
    progress: dict[int, int] = field(default_factory=dict)  # board index -> end block copied

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Another rank's report of the same step: the same blocks, copied in parallel."""
        assert isinstance(other, PddWorkerMetadata)
        return PddWorkerMetadata(
            _merge(self.loads, other.loads, CopyStat.slowest),
            _merge(self.saves, other.saves, CopyStat.slowest),
            _merge(self.progress, other.progress, max),
        )


def _merge(a: dict, b: dict, both) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = both(out[key], value) if key in out else value
    return out
