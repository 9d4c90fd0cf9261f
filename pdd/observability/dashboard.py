"""The Grafana dashboard (``deploy/grafana/pdd-dashboard.json``) as data: its panels, their
PromQL, and the metric names that PromQL reads.

``metric_names(expr)`` finds metric names in a PromQL expression without a full parser:
strings, label matchers ``{...}``, ranges ``[...]`` and the label lists of ``by``,
``without``, ``on``, ``ignoring``, ``group_left`` / ``group_right`` are dropped first; what
is left that looks like a name, is not a keyword and is not followed by ``(`` (a function)
is a metric. Good enough for the expressions dashboards use; the tests pin it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdd-dashboard.json"

_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
     "unless", "offset", "inf", "nan"}
)  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (series names as written, e.g. ``_bucket``)."""
    text = _LABEL_LIST.sub(" ", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _STRING.sub(" ", text)
    names = {m.group(1) for m in _NAME.finditer(text)}
    return {n for n in names if n.lower() not in _KEYWORDS and not re.fullmatch(r"[\d.e]+", n)}


def label_matchers(expr: str) -> list[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every matcher written in a selector."""
    out = []
    for selector in _SELECTOR.finditer(expr):
        for m in _MATCHER.finditer(selector.group(2)):
            out.append((selector.group(1), m.group(1), m.group(2), m.group(3)))
    return out


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # Grafana panel type (timeseries, stat, ...)
    unit: str
    targets: tuple[Target, ...]


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict) -> list[Panel]:
    """Every panel that shows data (rows left out, nested row panels included)."""
    flat = []
    for p in dashboard["panels"]:
        flat.extend(p.get("panels", []) if p["type"] == "row" else [p])
    return [
        Panel(
            p.get("title", ""),
            p["type"],
            p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
            tuple(
                Target(t.get("expr", ""), t.get("legendFormat", "")) for t in p.get("targets", [])
            ),
        )
        for p in flat
    ]


def dashboard_metrics(dashboard: dict) -> set[str]:
    """Every metric name any panel reads."""
    return {n for p in panels(dashboard) for t in p.targets for n in metric_names(t.expr)}
