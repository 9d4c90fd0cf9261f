"""What a benchmark run produced: records per phase, summaries per group, workload and mode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdd.bench.serve.client import RequestRecord
from pdd.bench.serve.config import SlaConfig
from pdd.bench.serve.metrics import Summary, summarize


@dataclass
class PhaseResult:
    """One phase: the warm-up or the measured requests of one group."""

    group: str
    warmup: bool
    records: list[RequestRecord]
    wall_s: float
    not_sent: int = 0
    link_bytes: int | None = None  # bytes on the lab's WAN during the phase (metered runs)


@dataclass
class WorkloadResult:
    """One workload on one mode: a summary per group and one over every measured phase."""

    name: str
    phases: list[PhaseResult]
    hits: dict[str, float | None]  # group -> sweep bucket (None outside the sweep)
    groups: dict[str, Summary] = field(default_factory=dict)
    summary: Summary = field(default_factory=Summary)

    @classmethod
    def build(
        cls,
        name: str,
        phases: list[PhaseResult],
        hits: dict[str, float | None],
        sla: SlaConfig,
        cost: float,
    ) -> WorkloadResult:
        measured = [p for p in phases if not p.warmup]
        groups = {
            p.group: summarize(p.records, p.wall_s, sla, cost, p.not_sent, p.link_bytes)
            for p in measured
        }
        every = [r for p in measured for r in p.records]
        links = [p.link_bytes for p in measured]
        total = summarize(
            every,
            sum(p.wall_s for p in measured),
            sla,
            cost,
            sum(p.not_sent for p in measured),
            None if None in links else sum(links),  # type: ignore[arg-type]
        )
        return cls(name, phases, hits, groups, total)

    def records(self, warmup: bool = False) -> list[RequestRecord]:
        return [r for p in self.phases if p.warmup == warmup for r in p.records]

    def errors(self) -> int:
        """Failed requests, warm-up included (a failed warm-up spoils what follows)."""
        return sum(1 for p in self.phases for r in p.records if not r.ok)


@dataclass
class ModeResult:
    """Every workload run against one mode, or why the mode could not run."""

    name: str
    workers: dict[str, int]
    cost_per_hour: float
    url: str | None = None
    workloads: dict[str, WorkloadResult] = field(default_factory=dict)
    error: str | None = None

    def errors(self) -> int:
        return sum(w.errors() for w in self.workloads.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "workers": self.workers,
            "cost_per_hour": self.cost_per_hour,
            "error": self.error,
            "workloads": {
                name: {
                    "summary": w.summary.to_json(),
                    "groups": {
                        g: dict(s.to_json(), hit=w.hits.get(g)) for g, s in w.groups.items()
                    },
                    "warmup_errors": sum(1 for r in w.records(warmup=True) if not r.ok),
                }
                for name, w in self.workloads.items()
            },
        }
