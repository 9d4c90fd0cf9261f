"""Routing policy: a pure function of a fleet snapshot.

    choose(view: FleetView, request: RouteRequest) -> Decision

No sockets, no clocks, no mutation: the pool builds a ``FleetView`` (health, load) and the
service hands the ``Decision`` to the pipeline driver of ``decision.pipeline``. The PDD
policy (p_md vs p_rld_md from the bytes the WAN must carry, prefix affinity, RLD load) is
added here as more ``RouterMode`` branches; unit tests drive it with built snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.errors import UnavailableError
from pdd.protocol import Pipeline, Role, RouterMode


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router last saw it."""

    id: str
    role: Role
    healthy: bool
    in_flight: int = 0  # requests this router has running on the worker right now
    running: int = 0  # from the worker's last Stats (all routers)
    waiting: int = 0
    kv_cache_usage: float = 0.0

    @property
    def load(self) -> int:
        """Requests on the worker: this router's live count, or the worker's own if higher."""
        return max(self.in_flight, self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class FleetView:
    mode: RouterMode
    workers: tuple[WorkerView, ...]

    def healthy(self, role: Role) -> list[WorkerView]:
        return [w for w in self.workers if w.healthy and w.role is role]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What policy may look at. Prefix-affinity inputs (block hashes) will join later."""

    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Decision:
    """The pipeline to run and the worker chosen for each role it uses."""

    pipeline: Pipeline
    assignments: tuple[tuple[Role, str], ...]

    def worker(self, role: Role) -> str:
        for r, worker_id in self.assignments:
            if r is role:
                return worker_id
        raise KeyError(f"decision for {self.pipeline.value} has no {role.value} worker")


def choose(view: FleetView, request: RouteRequest) -> Decision:
    """Pick the pipeline and workers. Raises UnavailableError when no worker can serve."""
    if view.mode is RouterMode.COLOCATED:
        worker = least_loaded(view.healthy(Role.COLOCATED))
        if worker is None:
            raise UnavailableError(_no_worker_message(view, Role.COLOCATED))
        return Decision(Pipeline.COLOCATED, ((Role.COLOCATED, worker.id),))
    raise UnavailableError(f"router.mode {view.mode.value!r} has no routing policy yet")


def least_loaded(candidates: list[WorkerView]) -> WorkerView | None:
    """Lowest load; ties by KV cache usage, then by id (deterministic)."""
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.load, w.kv_cache_usage, w.id))


def _no_worker_message(view: FleetView, role: Role) -> str:
    total = sum(1 for w in view.workers if w.role is role)
    if total == 0:
        return f"no {role.value} worker is configured"
    return f"no healthy {role.value} worker (0 of {total} healthy); retry later"
