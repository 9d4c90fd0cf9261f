"""pdd/bench/render_dashboard.py's offline parts: legends, units, drawing. (Running it needs
a live system and Prometheus: see the script's docstring.)"""

from __future__ import annotations

from pdd.bench.render_dashboard import UNITS, draw, legend
from pdd.observability.dashboard import load, panels


def test_legend_formats_like_grafana():
    labels = {"pipeline": "p_md", "instance": "127.0.0.1:9101"}
    assert legend("p99 {{pipeline}}", labels) == "p99 p_md"
    assert legend("{{ instance }} {{role}}", labels) == "127.0.0.1:9101"
    assert legend("", {"mode": "one_shot"}) == "mode=one_shot"


def test_every_dashboard_unit_is_drawable():
    assert {p.unit for p in panels(load())} <= set(UNITS)


def test_draw_writes_one_subplot_per_panel(tmp_path):
    data = [
        {"title": "TTFT", "unit": "s", "series": [{"legend": "p50", "points": [(0, 1), (1, 2)]}]},
        {"title": "Empty", "unit": "percentunit", "series": []},
    ]
    out = tmp_path / "d.png"
    draw(data, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
