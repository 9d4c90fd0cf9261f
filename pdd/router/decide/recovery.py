"""Failure recovery decisions for one request: is a failure a lost worker, and who takes over.

Pure functions over a ``FleetView`` snapshot (no I/O); the drivers (``pdd_pipeline``,
``request_run``, ``handoff``) call them and act:

    lost worker    ``is_worker_loss(exc)``: the worker's stream broke (UNAVAILABLE: process
                   gone or unreachable; the stream ended without a finish; an internal error),
                   or it ended the request with ``error`` / ``abort`` before it was finished.
                   A bad request, an overload (429) or the request's own deadline is not.
    P before t1    another healthy prefill worker, least loaded (``replacement``): the P stage
                   runs again there; after P's token nothing of P is needed but its KV sends,
                   and a failed send only makes the destinations recompute.
    the last tier  (MD in p_md, MD after the switch, the takeover of an earlier takeover)
                   ``takeover``: another healthy main_decode (longest prefix in its DRC view,
                   then least loaded), else a relay_decode, else a prefill worker. It continues
                   ``prompt + emitted`` with no KV handed over: it recomputes that KV itself
                   (extend-decode), so the client stream goes on with no repeat and no gap.

A worker a request saw fail is excluded (the view is rebuilt with it marked unhealthy) and
``RequestRun.generate`` has already marked it unhealthy in the pool, so the next requests avoid
it until its health check passes again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from pdd.errors import UnavailableError, WorkerError
from pdd.protocol import Role
from pdd.router.decide.view import FleetView, WorkerView, kv_conflict, least_loaded

TAKEOVER_ROLES = (Role.MAIN_DECODE, Role.RELAY_DECODE, Role.PREFILL)
TIER_OF_ROLE = {Role.MAIN_DECODE: "md", Role.RELAY_DECODE: "rld", Role.PREFILL: "p"}
LOST_FINISHES = ("error", "abort")  # a worker's finish that does not end the request


class WorkerLost(WorkerError):
    """A worker ended a request with ``error`` / ``abort`` before the request was finished."""


def is_worker_loss(exc: BaseException) -> bool:
    """True when ``exc`` means the worker (not the request) failed: another may take over."""
    if isinstance(exc, UnavailableError):
        return True
    return isinstance(exc, WorkerError) and exc.code != "timeout"


def is_unreachable(exc: BaseException) -> bool:
    """For a KV control RPC (PrepareKv, AwaitKv), which a live worker answers at once: a loss,
    or the RPC's deadline passing (the worker is cut off, e.g. by a WAN partition, or stuck).
    Not for Generate, whose deadline is the request's own."""
    return is_worker_loss(exc) or (isinstance(exc, WorkerError) and exc.code == "timeout")


def without(view: FleetView, excluded: Collection[str]) -> FleetView:
    """``view`` with every worker in ``excluded`` marked unhealthy."""
    workers = tuple(replace(w, healthy=False) if w.id in excluded else w for w in view.workers)
    return replace(view, workers=workers)


def replacement(
    view: FleetView, role: Role, excluded: Collection[str], sends_to: Collection[str] = ()
) -> WorkerView | None:
    """The least loaded healthy worker of ``role`` that is not excluded and whose KV every
    worker in ``sends_to`` can take (a P replaced mid-request keeps the request's RLD/MD:
    never a pair of KV geometries that cannot exchange KV, ``view.kv_conflict``)."""
    peers = [w for w in view.workers if w.id in sends_to]
    live = without(view, excluded).healthy(role)
    return least_loaded([w for w in live if all(kv_conflict(w, r) is None for r in peers)])


def takeover(
    view: FleetView, excluded: Collection[str], md_cached_tokens: Mapping[str, int]
) -> WorkerView | None:
    """Who continues a request whose last tier was lost: MD, else RLD, else P (module doc)."""
    live = without(view, excluded)
    mds = live.healthy(Role.MAIN_DECODE)
    if mds:
        best = max(md_cached_tokens.get(w.id, 0) for w in mds)
        return least_loaded([w for w in mds if md_cached_tokens.get(w.id, 0) == best])
    for role in TAKEOVER_ROLES[1:]:
        found = least_loaded(live.healthy(role))
        if found is not None:
            return found
    return None
