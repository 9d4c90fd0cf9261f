"""Routing policy on built snapshots (no sockets)."""

from __future__ import annotations

import pytest

from pdd.errors import UnavailableError
from pdd.protocol import Pipeline, Role, RouterMode
from pdd.router.decide.routing import Decision, FleetView, RouteRequest, WorkerView, choose

REQ = RouteRequest(prompt_tokens=100, max_tokens=16)


def w(id_, healthy=True, role=Role.COLOCATED, **kw):
    return WorkerView(id=id_, role=role, healthy=healthy, **kw)


def colocated(*workers):
    return FleetView(RouterMode.COLOCATED, tuple(workers))


def test_least_loaded_healthy_colocated_worker_wins():
    view = colocated(
        w("a", in_flight=3),
        w("b", in_flight=1, running=2),  # the worker's own count is higher: load 2
        w("c", in_flight=1),
        w("d", healthy=False),
        w("p", role=Role.PREFILL),
    )
    assert choose(view, REQ) == Decision(Pipeline.COLOCATED, ((Role.COLOCATED, "c"),))
    assert choose(view, REQ).worker(Role.COLOCATED) == "c"


def test_ties_break_on_kv_usage_then_id():
    view = colocated(
        w("b", kv_cache_usage=0.5), w("c", kv_cache_usage=0.1), w("a", kv_cache_usage=0.1)
    )
    assert choose(view, REQ).worker(Role.COLOCATED) == "a"


def test_waiting_requests_count_as_load():
    view = colocated(w("a", running=1, waiting=3), w("b", running=3))
    assert choose(view, REQ).worker(Role.COLOCATED) == "b"


def test_no_healthy_worker_is_unavailable():
    with pytest.raises(UnavailableError) as info:
        choose(colocated(w("a", healthy=False), w("b", healthy=False)), REQ)
    assert info.value.message == "no healthy colocated worker (0 of 2 healthy); retry later"
    assert info.value.status_code == 503
    with pytest.raises(UnavailableError) as info:
        choose(colocated(w("p", role=Role.PREFILL)), REQ)
    assert info.value.message == "no colocated worker is configured"


def test_modes_without_policy_are_unavailable():
    with pytest.raises(UnavailableError):
        choose(FleetView(RouterMode.PDD, (w("a"),)), REQ)


def test_decision_worker_lookup_for_missing_role():
    d = Decision(Pipeline.COLOCATED, ((Role.COLOCATED, "a"),))
    with pytest.raises(KeyError):
        d.worker(Role.MAIN_DECODE)
