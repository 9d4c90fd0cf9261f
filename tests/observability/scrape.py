"""Reading Prometheus text: families by their catalog name (counters with ``_total``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


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
    """Families of a scrape by catalog name; ``_created`` samples are left out."""
    out: dict[str, Family] = {}
    for fam in text_string_to_metric_families(text):
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
