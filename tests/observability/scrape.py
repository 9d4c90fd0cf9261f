"""Reading Prometheus scrapes: families by catalog name (``parse``), or sample sums by series
name as Prometheus stores them (``samples``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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


def parse(text: str) -> dict[str, Family]:
    """Families of a classic-text scrape by catalog name (only those with samples);
    ``_created`` samples are left out."""
    out: dict[str, Family] = {}
    for fam in text_string_to_metric_families(text):
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


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")


def samples(text: str) -> dict[str, float]:
    """Per sample name (as Prometheus stores series: ``x_total``, ``x_count``, ...), the sum of
    its values over all label sets. A plain line reader that takes classic text and
    OpenMetrics alike, as lenient as Prometheus (which stores samples by their own name)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        name, value = m.group(1), float(m.group(3))
        out[name] = out.get(name, 0.0) + value
    return out
