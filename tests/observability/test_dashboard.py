"""deploy/grafana/pdd-dashboard.json: it parses, every panel shows something, and every
expression reads only catalog metrics, with labels and label values those metrics have."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdd.observability import catalog
from pdd.observability.dashboard import (
    DASHBOARD,
    dashboard_metrics,
    label_matchers,
    load,
    metric_names,
    panels,
)
from pdd.protocol import HandoffMode, Pipeline, Role

# Labels Prometheus adds to every scraped series (the scrape configs in deploy/prometheus).
TARGET_LABELS = {"instance", "job", "role", "datacenter"}
# Values a matcher may name, per label (the closed sets the code uses).
VALUES = {
    "role": {r.value for r in Role},
    "pipeline": {p.value for p in Pipeline},
    "mode": {m.value for m in HandoffMode},
    "tier": {"p", "rld", "md", "d", "colocated"},
    "transport": {"ucx", "tcp", "inproc"},
}
# Every row of the dashboard, by the panel title that shows it.
REQUIRED_TITLES = [
    "TTFT P50 / P90 / P99 per pipeline", "Pipeline mix", "WAN throughput",
    "DRC hit rate (tokens)", "RLD load", "Handoffs per second by mode", "SLA goodput",
    "BCR: good requests per cost unit",
]  # fmt: skip


def test_metric_names_parser():
    expr = (
        'sum by (le, pipeline) (rate(pdd_a_bucket{role="prefill"}[$__rate_interval])) '
        "/ ignoring(pipeline) group_left sum(vllm:b_total offset 5m) + 1e6 * on(role) pdd_c"
    )
    assert metric_names(expr) == {"pdd_a_bucket", "vllm:b_total", "pdd_c"}
    assert metric_names("histogram_quantile(0.99, sum(rate(x_bucket[5m])) by (le))") == {"x_bucket"}


def test_dashboard_parses_and_has_the_grafana_shape():
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] == "pdd-overview" and dash["title"]
    (var,) = dash["templating"]["list"]
    assert (var["name"], var["type"], var["query"]) == ("datasource", "datasource", "prometheus")
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_panel_has_a_title_and_a_target():
    shown = panels(load())
    assert len(shown) >= 20
    titles = [p.title for p in shown]
    assert len(titles) == len(set(titles))
    for p in shown:
        assert p.title.strip(), p
        assert p.targets and all(t.expr.strip() for t in p.targets), p.title
    assert set(REQUIRED_TITLES) <= set(titles)


def test_every_metric_the_dashboard_reads_is_in_the_catalog():
    unknown = []
    for name in sorted(dashboard_metrics(load())):
        try:
            catalog.get(name)
        except KeyError:
            unknown.append(name)
    assert unknown == []


def test_label_matchers_use_the_metrics_labels_and_known_values():
    for p in panels(load()):
        for t in p.targets:
            for metric, label, op, value in label_matchers(t.expr):
                spec = catalog.get(metric)
                assert label in set(spec.labels) | TARGET_LABELS, (p.title, metric, label)
                if label in VALUES:
                    wanted = set(value.split("|")) if op == "=~" else {value}
                    assert wanted <= VALUES[label], (p.title, label, value)
            for by in re.findall(r"\bby\s*\(([^)]*)\)", t.expr):
                labels = {x.strip() for x in by.split(",")} - {"le"}
                metrics = [catalog.get(n) for n in metric_names(t.expr)]
                known = set().union(*(set(m.labels) for m in metrics)) | TARGET_LABELS
                assert labels <= known, (p.title, labels)


def _promtool() -> str | None:
    found = shutil.which("promtool") or str(Path(sys.executable).parent / "promtool")
    return found if os.access(found, os.X_OK) else None


@pytest.mark.skipif(_promtool() is None, reason="promtool not installed (make tools)")
def test_every_expression_is_valid_promql(tmp_path):
    """promtool parses each expression (as a recording rule; Grafana's $__rate_interval
    becomes 1m)."""
    rules = [
        {"record": f"pdd:dashboard_check:{i}", "expr": t.expr.replace("$__rate_interval", "1m")}
        for i, t in enumerate(t for p in panels(load()) for t in p.targets)
    ]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout
