"""The metric catalog itself: names, units, labels, and the docs table that mirrors part of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdd.observability import catalog
from pdd.observability.catalog import CATALOG, Kind

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "operations.md"
# Base units end the name (token counts follow vLLM's names, e.g. prefix_cache_queries).
UNIT_SUFFIXES = {"seconds": "_seconds", "bytes": "_bytes"}


def test_names_follow_prometheus_conventions():
    for m in CATALOG:
        assert re.fullmatch(r"(pdd_|vllm:)[a-z0-9_]+", m.name), m.name
        assert m.name.endswith("_total") == (m.kind is Kind.COUNTER), m.name
        base = m.name.removesuffix("_total")
        suffix = UNIT_SUFFIXES.get(m.unit)
        if suffix and m.name.startswith("pdd_"):  # the unit is the name's last word
            assert base.endswith(suffix), f"{m.name} is in {m.unit}"
        assert m.exporters and m.exporters <= catalog.PROCESSES, m.name
        assert m.help.endswith(".") and m.status in ("built", "planned"), m.name


def test_labels_come_from_the_closed_set():
    for m in CATALOG:
        allowed = catalog.PDD_LABELS if m.name.startswith("pdd_") else set(catalog.VLLM_LABELS)
        assert set(m.labels) <= allowed, (m.name, m.labels)
        assert "le" not in m.labels and "request_id" not in m.labels


def test_lookup_by_series_name():
    ttft = catalog.get("pdd_time_to_first_token_seconds")
    for series in ttft.series:
        assert catalog.get(series) is ttft
    assert catalog.get("pdd_requests_total").family == "pdd_requests"
    drc = [m.name for m in catalog.exported_by("main_decode") if m.name.startswith("pdd_drc")]
    assert len(drc) == 6
    assert not any(m.name.startswith("pdd_drc") for m in catalog.exported_by("relay_decode"))
    with pytest.raises(KeyError):
        catalog.get("pdd_requests_total_bucket")  # a counter has no _bucket series


def test_docs_table_agrees_with_the_catalog():
    """docs/operations.md lists the metrics the Prometheus rules read; each row's status
    (built / planned) and exporter must be the catalog's."""
    rows = re.findall(
        r"^\| `((?:pdd_|vllm:)[a-z_:]+)(?:\{[^`]*\})?` \| (built|planned) \| ([^|]+) \|",
        DOCS.read_text(), re.M,
    )  # fmt: skip
    assert rows, "no metric table in docs/operations.md"
    for name, status, exporter in rows:
        spec = catalog.get(name.removesuffix("_bucket"))
        assert spec.status == status, f"{name}: docs say {status}, catalog {spec.status}"
        by_router = exporter.strip() == "router"
        assert by_router == (spec.exporters == {catalog.ROUTER}), (name, exporter)
