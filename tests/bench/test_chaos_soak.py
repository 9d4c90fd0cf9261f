"""The chaos soak's memory verdict for workers that get killed: the slope over each worker's
longest stretch without a kill, its start-up left out (pure; the soak itself is a benchmark)."""

from __future__ import annotations

import pytest

from pdd.bench.chaos_soak import steady_slopes


def test_the_slope_is_taken_over_the_longest_stretch_without_a_kill_after_its_warmup():
    samples = []
    for t in range(0, 1200, 5):
        if t < 300:  # first life: flat at 2,000 MiB
            p = 2000.0
        elif t < 360:  # killed at 300 s: the new engine starts, memory climbs
            p = 500.0 + 25 * (t - 300)
        else:  # its long second life: +1 MiB/min
            p = 2000.0 + (t - 360) / 60
        samples.append({"t_s": float(t), "p": p, "md": 1000.0})
    events = [{"t_s": 300.0, "fault": "kill", "worker": "p"},
              {"t_s": 500.0, "fault": "pause", "worker": "md"}]  # fmt: skip
    got = steady_slopes(samples, events, ["p", "md"])
    assert (got["p"]["from_s"], got["p"]["to_s"]) == (300.0, 1195.0)
    assert got["p"]["slope"] == pytest.approx(1.0, abs=0.01)  # the ramp is not in it
    assert got["md"] == {"slope": 0.0, "from_s": 0.0, "to_s": 1195.0}  # a pause is no restart
