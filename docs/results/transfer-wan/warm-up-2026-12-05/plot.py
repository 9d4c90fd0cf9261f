"""Draws first-transfer.png from this folder's runs: python plot.py (from this folder)."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
runs = sorted(here.glob("idle*.json"), key=lambda p: (len(p.stem), p.stem))
labels, cold, warm = [], [], []
for p in runs:
    wan = json.loads(p.read_text())["wan"]["tcp"]
    labels.append(p.stem.replace("idle", "idle ").replace("-", " s, round "))
    cold.append(100 * wan["first"]["fraction_of_link"])
    warm.append(100 * wan["first_after_warm_up"]["fraction_of_link"])
fig, ax = plt.subplots(figsize=(9, 4.5))
xs = range(len(runs))
ax.bar([x - 0.2 for x in xs], cold, 0.4, label="cold: a new peer, no warm-up")
ax.bar([x + 0.2 for x in xs], warm, 0.4, label="warmed up (WarmKv), then idle")
ax.axhline(80, color="k", ls="--", lw=1, label="target 80%")
ax.set_xticks(list(xs), labels, rotation=20)
ax.set_ylabel("first 64 MiB, % of the 1 Gbit/s link")
ax.set_ylim(0, 100)
ax.set_title("First transfer to a new peer, lab 1 Gbit/s x 40 ms RTT")
ax.legend(loc="lower right")
fig.tight_layout()
fig.savefig(here / "first-transfer.png", dpi=110)
