"""Reading Prometheus text: families by their catalog name (counters with ``_total``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

# What Prometheus 2.x sends: OpenMetrics first, the classic text format as a fallback.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


@dataclass
class Family:
    kind: str  # counter | gauge | histogram | ...
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def labels(self) -> set[str]:
        return {k for (_, labels) in self.samples for k, _ in labels}

    def total(self, sample: str | None = None, **match: str) -> float:
        """Sum of the samples named ``sample`` (default: the family's value / ``_count``)."""
        return sum(
            v
            for (name, labels), v in self.samples.items()
            if (sample is None or name == sample)
            and all(dict(labels).get(k) == want for k, want in match.items())
        )


def parse(text: str, content_type: str = "text/plain") -> dict[str, Family]:
    """Families of a scrape by catalog name (only those with samples); ``_created`` samples
    are left out. ``content_type``: the response's, to read OpenMetrics too."""
    out: dict[str, Family] = {}
    om = content_type.startswith("application/openmetrics-text")
    for fam in (openmetrics_families if om else text_string_to_metric_families)(text):
        if not fam.samples:
            continue
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        if fam.type == "gauge" and fam.name.endswith("_created"):
            continue
        f = out.setdefault(name, Family(fam.type))
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            f.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(families: dict[str, Family], name: str, **labels: str) -> float:
    """The summed value of a counter/gauge (a histogram: its ``_count``) over matching series."""
    f = families[name]
    sample = f"{name}_count" if f.kind == "histogram" else name
    return f.total(sample, **labels)
