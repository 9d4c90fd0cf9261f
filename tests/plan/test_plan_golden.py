"""The optimised simulator gives the figures the simulator gave before it (seeded runs).

``data/sim_golden.json`` holds what commit 78cb16e's simulator computed for the cases of
``tests/plan/sim_cases.py`` (every pipeline, handoff and baseline, the exact RadixIndex cache,
a trace). Counts must match exactly; times and byte sums to 1e-9 (the batch arithmetic now
sums per server, not per sequence).
"""

from __future__ import annotations

import json

import pytest

from tests.plan.sim_cases import GOLDEN, cases, run_case

WANT = json.loads(GOLDEN.read_text())


def _same(got: object, want: object, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, float) and not isinstance(got, int | str):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12, nan_ok=True), where
    else:
        assert got == want, where


@pytest.mark.parametrize("name", sorted(cases()))
def test_simulator_reproduces_the_pinned_figures(name: str) -> None:
    _same(run_case(name), WANT[name], name)
