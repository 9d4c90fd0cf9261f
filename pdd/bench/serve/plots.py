"""PNG plots of a run (matplotlib, Agg backend; no display needed).

- ``ttft_cdf.png``: TTFT CDF per mode, one panel per workload.
- ``bathtub.png``: SLA goodput and BCR against the prefix hit rate, per mode (sweep buckets).
  Written only when a workload with hit buckets (the sweep) ran.
- ``wan_bytes.png``: WAN KV bytes per request, and in total (the metered link bytes when the
  run metered a lab), per mode and workload.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from pdd.bench.serve.config import BenchConfig  # noqa: E402
from pdd.bench.serve.results import ModeResult  # noqa: E402


def write_plots(out: Path, modes: list[ModeResult], cfg: BenchConfig) -> list[Path]:
    ran = [m for m in modes if m.workloads]
    files = [_ttft_cdf(out / "ttft_cdf.png", ran, cfg)]
    bathtub = _bathtub(out / "bathtub.png", ran)
    if bathtub is not None:
        files.append(bathtub)
    files.append(_wan_bytes(out / "wan_bytes.png", ran))
    return files


def _workload_names(modes: list[ModeResult]) -> list[str]:
    names: list[str] = []
    for m in modes:
        names += [n for n in m.workloads if n not in names]
    return names


def _ttft_cdf(path: Path, modes: list[ModeResult], cfg: BenchConfig) -> Path:
    names = _workload_names(modes) or ["(none)"]
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for m in modes:
            w = m.workloads.get(name)
            if w is None:
                continue
            ttft = sorted(r.ttft_s for r in w.records() if r.ok and r.ttft_s is not None)
            if ttft:
                ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
                ax.step(ttft, ys, where="post", label=m.name)
        ax.axvline(cfg.sla.ttft_s, color="grey", linestyle=":", label="SLA TTFT")
        ax.set_title(f"TTFT CDF: {name}")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bathtub(path: Path, modes: list[ModeResult]) -> Path | None:
    series = []
    for m in modes:
        for name, w in m.workloads.items():
            points = sorted(
                (hit, w.groups[g]) for g, hit in w.hits.items() if hit is not None and g in w.groups
            )
            if points:
                series.append((f"{m.name}" if name == "sweep" else f"{m.name} ({name})", points))
    if not series:
        return None
    fig, (ax_good, ax_bcr) = plt.subplots(1, 2, figsize=(11, 4))
    for label, points in series:
        xs = [100 * hit for hit, _ in points]
        ax_good.plot(xs, [s.goodput_rps for _, s in points], marker="o", label=label)
        bcr = [(x, s.bcr) for x, (_, s) in zip(xs, points, strict=True) if s.bcr is not None]
        if bcr:
            ax_bcr.plot([x for x, _ in bcr], [b for _, b in bcr], marker="o", label=label)
    ax_good.set_title("SLA goodput vs prefix hit rate")
    ax_good.set_ylabel("goodput (req/s within SLA)")
    ax_bcr.set_title("BCR vs prefix hit rate (the bathtub)")
    ax_bcr.set_ylabel("goodput / cost per hour")
    for ax in (ax_good, ax_bcr):
        ax.set_xlabel("prefix hit rate (%)")
        ax.set_xlim(-2, 102)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wan_bytes(path: Path, modes: list[ModeResult]) -> Path:
    names = _workload_names(modes)
    metered = any(
        w.summary.link_bytes_total is not None for m in modes for w in m.workloads.values()
    )
    fig, (ax_req, ax_total) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs, per_req, total = [], [], []
        for j, m in enumerate(modes):
            w = m.workloads.get(name)
            if w is None:
                continue
            xs.append(j + i * width)
            per_req.append(w.summary.wan_bytes_per_request or 0.0)
            s = w.summary
            total.append((s.link_bytes_total or 0) if metered else s.wan_bytes_total)
        for ax, ys in ((ax_req, per_req), (ax_total, total)):
            bars = ax.bar(xs, ys, width=width, label=name)
            ax.bar_label(bars, labels=[_human(y) for y in ys], fontsize=7)
    total_title = "bytes on the WAN link (metered)" if metered else "WAN KV bytes in total"
    req_title = "KV bytes P queued per request (for MD or D)"
    for ax, title in ((ax_req, req_title), (ax_total, total_title)):
        ax.set_title(title)
        ax.set_ylim(bottom=0, top=max(1.0, ax.get_ylim()[1]))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))], [m.name for m in modes])
        ax.set_ylabel("bytes")
        ax.grid(alpha=0.3, axis="y")
        if names:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _human(v: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if v < 1000 or unit == "GB":
            return f"{v:.0f} {unit}"
        v /= 1000
    return f"{v:.0f}"
