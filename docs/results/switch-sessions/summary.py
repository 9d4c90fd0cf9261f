"""The gap at the switch per arm of session_ab.sh (run*-ARM.json from `pdd bench handoff-gap`).

usage: python summary.py [DIR]  (default: this folder; min-rounds/ holds the second A/B)
"""

import glob
import json
import os
import statistics
import sys

ARMS = {
    "S": "sessions on, min_catch_up_rounds 1",
    "N": "sessions off, min_catch_up_rounds 1",
    "M": "sessions off, min_catch_up_rounds 0 (before)",
    "Z": "sessions on, min_catch_up_rounds 0",
}
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
gaps: dict[str, list[float]] = {a: [] for a in ARMS}
largest: dict[str, list[float]] = {a: [] for a in ARMS}
for path in sorted(glob.glob(os.path.join(here, "run*-*.json"))):
    arm = os.path.basename(path).split("-")[1][0]
    for run in json.load(open(path))["runs"]:
        if run.get("switch_gap_ms") is not None:
            gaps[arm].append(run["switch_gap_ms"])
            largest[arm].append(run["max_gap_ms"])
print("| arm | gap at the switch, ms | median | largest gap (median) |")
print("| --- | --- | --- | --- |")
for arm, name in ARMS.items():
    if not gaps[arm]:
        continue
    each = " / ".join(f"{g:.0f}" for g in gaps[arm])
    print(
        f"| {name} | {each} | {statistics.median(gaps[arm]):.0f} | "
        f"{statistics.median(largest[arm]):.0f} |"
    )
