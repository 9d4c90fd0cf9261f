"""Routing policy: a pure function of a fleet snapshot.

    choose(view: FleetView, request: RouteRequest) -> Decision

No sockets, no clocks, no mutation: the pool builds a ``FleetView`` (health, load, KV-plane
stats), the service builds the ``RouteRequest`` (with each MD's cached prefix from the DRC
views) and hands the ``Decision`` to the pipeline driver of ``decision.pipeline``. The modes'
policies: colocated here; pdd and the pd baselines in ``pdd.router.decide.policy``.
"""

from __future__ import annotations

from pdd.errors import InvalidRequestError, UnavailableError
from pdd.protocol import Pipeline, Role, RouterMode
from pdd.router.decide.policy import choose_pd, choose_pdd, no_worker_message
from pdd.router.decide.view import Decision, FleetView, RouteRequest, WorkerView, least_loaded

__all__ = ["Decision", "FleetView", "RouteRequest", "WorkerView", "choose", "least_loaded"]


def choose(view: FleetView, request: RouteRequest) -> Decision:
    """Pick the pipeline and workers.

    Raises UnavailableError when no worker can serve, InvalidRequestError when the request
    forces a pipeline the router mode does not run.
    """
    if view.mode is RouterMode.PDD:
        return choose_pdd(view, request)
    if request.pipeline is not None or request.handoff is not None:
        raise InvalidRequestError(
            f"pdd.pipeline/pdd.handoff overrides need router.mode pdd (this router runs "
            f"{view.mode.value})",
            param="pdd",
        )
    if view.mode in (RouterMode.PD_WAN, RouterMode.PD_LOCAL):
        return choose_pd(view, request)
    worker = least_loaded(view.healthy(Role.COLOCATED))
    if worker is None:
        raise UnavailableError(no_worker_message(view, Role.COLOCATED))
    return Decision(Pipeline.COLOCATED, ((Role.COLOCATED, worker.id),))
