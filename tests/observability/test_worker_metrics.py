"""What a worker's /metrics shows (pdd/worker/metrics.py, fed fake snapshots: no engine)
against the catalog: each pdd_* family it exports is a catalog entry marked built, and each
built worker entry is exported. Planned entries (the worker does not export them yet) are
listed by ``test_planned_worker_metrics_are_not_exported_yet``: when the worker starts
exporting one, flip its status in pdd/observability/catalog.py."""

from __future__ import annotations

import typing

from prometheus_client import REGISTRY, generate_latest

from pdd.cache.messages import DrcStats
from pdd.engine.types import EngineStats
from pdd.observability import catalog
from pdd.worker import kv_plane
from pdd.worker.metrics import WorkerMetrics
from pdd.worker.roles import KvStats
from tests.observability.scrape import parse

ROLES = ("prefill", "relay_decode", "main_decode", "colocated")


def _drc_stats() -> DrcStats:
    values = {str: "epoch", int: 3, float: 0.5}
    hints = typing.get_type_hints(DrcStats)
    return DrcStats.model_validate({n: values[hints[n]] for n in DrcStats.model_fields})


def _scrape(role: str) -> dict:
    engine = EngineStats(running=1, waiting=2, kv_cache_usage=0.5, prefix_cache_queries=10,
                         prefix_cache_hits=5, generated_tokens=7, max_model_len=4096)  # fmt: skip
    kv = None
    if role != "colocated":
        drc = _drc_stats() if role == "main_decode" else None
        kv = KvStats(pinned_slots=1, open_transfers=1, drc=drc, wan_bandwidth_bps=1e8)
    if role == "prefill":  # per-transport counters appear with P's first finished send
        kv_plane._TRANSFER_BYTES.labels(role, "tcp").inc(0)
        kv_plane._WIRE_BYTES.labels(role, "tcp").inc(0)
        kv_plane._TRANSFERS.labels(role, "tcp", "done").inc(0)
        kv_plane._TRANSFER_SECONDS.labels(role, "tcp")
    if role in ("relay_decode", "main_decode"):  # a receiving KvPlane creates it at start
        kv_plane._INTERNAL_ERRORS.labels(role)
    metrics = WorkerMetrics(role, lambda: engine, lambda: kv)
    try:
        metrics.request_done(role, "stop")
        return {n: f for n, f in parse(generate_latest(REGISTRY).decode()).items()
                if n.startswith("pdd_")}  # fmt: skip
    finally:
        metrics.close()


def test_worker_exports_only_built_catalog_metrics_with_their_types():
    for role in ROLES:
        for name, fam in _scrape(role).items():
            spec = catalog.get(name)
            assert spec.status == "built", f"{name}: exported, but the catalog says planned"
            assert spec.exporters & catalog.WORKERS, name
            assert fam.kind == spec.kind.value, name
            assert fam.labels() - {"le"} <= set(spec.labels), name


def test_worker_exports_every_built_catalog_metric_of_its_role():
    for role in ROLES:
        exported = set(_scrape(role))
        wanted = {  # vllm:* come from a running engine (tests/observability/live.py)
            m.name
            for m in catalog.exported_by(role)
            if m.status == "built" and m.name.startswith("pdd_")
        }
        assert wanted - exported == set(), role


def test_planned_worker_metrics_are_not_exported_yet():
    """The catalog's planned pdd_* worker metrics: what the worker side still has to add."""
    planned = {m.name for m in catalog.planned() if m.name.startswith("pdd_")}
    assert planned == set()
    exported = set().union(*(set(_scrape(role)) for role in ROLES))
    assert planned & exported == set()
