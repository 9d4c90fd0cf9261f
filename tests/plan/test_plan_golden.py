"""The optimised simulator gives the figures the simulator gave before it (seeded runs).

``data/sim_golden.json`` holds what the simulator computed for the cases of
``tests/plan/sim_cases.py`` (every pipeline, handoff and baseline, the exact RadixIndex cache,
a trace) when its WAN link became fair-shared like pdd's TCP sender (it was first-in-first-out
until then; every other figure had been pinned since commit 78cb16e), and, for
``pdd_rld_finished``, when RLD finishing first stopped cutting MD's transfer (issue 16, item 6:
it finishes behind every other, until P's send deadline), and, for ``pdd_relay`` and
``pdd_rld_finished``, when a run's duration became its last request's end or the link's last
byte instead of the time a stale timer of the link fired (utilisations), and, for
``pd_wan`` and ``pd_local``, when the baselines' D began to get only the blocks its DRC lacks
(issue 16, item 8: vLLM's decoder pulls only what its prefix cache lacks), and when pdd's
TCP sender, and so the link, began to carry the transfer with the fewest bytes left first
instead of sharing it equally (issue 16, item 5), and, for ``pdd_relay``, when Catch-Up began
to warm MD up at least once however small the gap (``min_catch_up_rounds``: with MD's
Catch-Up sessions the switch then computes only what RLD emitted since), and, for
``pdd_busy_md``, when ``router.pdd.md_recompute`` became the default, bounded by
``md_recompute_max_tokens`` (its MD, on P's chip, computes some short misses itself; every
other case's figures stayed the same). Counts must match
exactly; times and byte sums to 1e-9. Regenerate with ``python -m tests.plan.sim_cases`` only
for a change of the model, never of speed.
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
