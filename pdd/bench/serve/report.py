"""Writes a run's results folder: results.json, requests.jsonl, report.md and the PNG plots.

``results.json``: the effective config, the workloads' shape (target hit rates), and per mode
and workload a summary and per-group summaries (see ``metrics.Summary``). ``requests.jsonl``:
one line per request (warm-up included) with its timings and pdd facts. ``report.md``: the
same numbers as tables. Plots: see ``plots``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdd.bench.serve.compare import compare
from pdd.bench.serve.compare import markdown as compare_markdown
from pdd.bench.serve.config import BenchConfig
from pdd.bench.serve.metrics import Summary
from pdd.bench.serve.plots import write_plots
from pdd.bench.serve.results import ModeResult
from pdd.bench.serve.workload import Workload


def workload_shape(wl: Workload) -> dict[str, Any]:
    """How the generated workload looks, before any server sees it."""
    measured = [r for r in wl.requests if not r.warmup]
    hits = [r.target_hit for r in measured if r.target_hit is not None]
    prompts = [r.prompt_tokens for r in measured if r.prompt_tokens]
    return {
        "requests": len(wl.requests),
        "measured": len(measured),
        "groups": [g.name for g in wl.groups],
        "token_model": wl.token_model,
        "target_hit_mean": sum(hits) / len(hits) if hits else None,
        "target_hit_share_above_95": sum(h > 0.95 for h in hits) / len(hits) if hits else None,
        "prompt_tokens_mean": sum(prompts) / len(prompts) if prompts else None,
        "output_tokens_mean": sum(r.max_tokens for r in measured) / len(measured),
        "anomalies": sum(r.anomaly for r in measured),
    }


def write_report(
    out: Path,
    cfg: BenchConfig,
    workloads: dict[str, Workload],
    modes: list[ModeResult],
    meta: dict[str, Any],
) -> list[Path]:
    """Write every file of the results folder ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "meta": meta,
        "config": cfg.model_dump(mode="json"),
        "workloads": {name: workload_shape(wl) for name, wl in workloads.items()},
        "modes": {m.name: m.to_json() for m in modes},
        "comparison": compare(modes, cfg.compare),
    }
    files = [out / "results.json", out / "requests.jsonl", out / "report.md"]
    files[0].write_text(json.dumps(results, indent=2) + "\n")
    with files[1].open("w") as f:
        for m in modes:
            for name, w in m.workloads.items():
                for p in w.phases:
                    for r in p.records:
                        f.write(json.dumps(dict(r.to_json(), mode=m.name, workload=name)) + "\n")
    files[2].write_text(markdown(cfg, workloads, modes, meta, results["comparison"]))
    return files + write_plots(out, modes, cfg)


# --- markdown ------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _num(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(v) < 1000 or unit == "GB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1000
    return "-"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "-"


MODE_COLUMNS = (
    "mode | ok/sent | errors | TTFT P50 / P90 / P99 ms | 32nd token P50 / P90 ms "
    "| TPOT P50 / P99 ms | ITL P99 ms "
    "| max stall ms | E2E P50 / P99 ms | goodput req/s | SLA met | WAN KV / req | WAN KV total "
    "| link total "
    "| prefix hit | DRC hit | RLD share | pipelines | handoffs | cost/h | BCR"
)


def mode_row(name: str, s: Summary) -> str:
    cells = [
        name,
        f"{s.ok}/{s.requests}" + (f" (+{s.not_sent} not sent)" if s.not_sent else ""),
        str(s.errors),
        f"{_ms(s.ttft_p50_s)} / {_ms(s.ttft_p90_s)} / {_ms(s.ttft_p99_s)}",
        f"{_ms(s.t32_p50_s)} / {_ms(s.t32_p90_s)}",
        f"{_ms(s.tpot_p50_s)} / {_ms(s.tpot_p99_s)}",
        _ms(s.itl_p99_s),
        _ms(s.max_stall_s),
        f"{_ms(s.e2e_p50_s)} / {_ms(s.e2e_p99_s)}",
        _num(s.goodput_rps),
        _pct(s.sla_attainment),
        _bytes(s.wan_bytes_per_request),
        _bytes(s.wan_bytes_total),
        _bytes(s.link_bytes_total),
        _pct(s.prefix_hit_rate),
        _pct(s.drc_hit_rate),
        _pct(s.rld_token_share),
        _counts(s.pipelines),
        _counts(s.handoffs),
        _num(s.cost_per_hour),
        _num(s.bcr),
    ]
    return "| " + " | ".join(cells) + " |"


def _table(header: str, rows: list[str]) -> list[str]:
    cols = header.count("|") + 1
    return ["| " + header + " |", "|" + "---|" * cols, *rows, ""]


def markdown(
    cfg: BenchConfig,
    workloads: dict[str, Workload],
    modes: list[ModeResult],
    meta: dict[str, Any],
    comparison: dict[str, Any] | None = None,
) -> str:
    lines = [
        "# pdd bench serve",
        "",
        f"Started {meta.get('started', '?')}; seed {cfg.seed}; load {cfg.load.pattern} "
        + (
            f"(rate {cfg.load.rate}/s)"
            if cfg.load.pattern == "open"
            else f"(concurrency {cfg.load.concurrency})"
        )
        + f"; SLA TTFT <= {cfg.sla.ttft_s}s, TPOT <= {cfg.sla.tpot_s}s; "
        + "BCR = goodput (req/s) / cost per hour.",
        "",
    ]
    if comparison is not None:
        lines += compare_markdown(comparison)
    failed = [m for m in modes if m.error]
    for m in failed:
        lines += [f"**Mode {m.name} did not run:** {m.error.splitlines()[0]}", ""]
    for name, wl in workloads.items():
        shape = workload_shape(wl)
        lines += [
            f"## Workload `{name}`",
            "",
            f"{shape['measured']} measured of {shape['requests']} requests; target prefix hit "
            f"mean {_pct(shape['target_hit_mean'])}, above 95%: "
            f"{_pct(shape['target_hit_share_above_95'])}; tokens counted by "
            f"{shape['token_model']}.",
            "",
        ]
        rows = [mode_row(m.name, m.workloads[name].summary) for m in modes if name in m.workloads]
        lines += _table(MODE_COLUMNS, rows)
        if len(wl.groups) > 1:
            lines += _group_table(name, wl, modes)
    return "\n".join(lines)


def _group_table(name: str, wl: Workload, modes: list[ModeResult]) -> list[str]:
    ran = [m for m in modes if name in m.workloads]
    header = "group | " + " | ".join(
        f"{m.name} goodput / BCR / TTFT P50 ms / 32nd token P50 ms / prefix hit" for m in ran
    )
    rows = []
    for g in wl.groups:
        cells = [g.name]
        for m in ran:
            s = m.workloads[name].groups.get(g.name)
            if s is None:
                cells.append("-")
                continue
            cells.append(
                f"{_num(s.goodput_rps)} / {_num(s.bcr)} / {_ms(s.ttft_p50_s)} / "
                f"{_ms(s.t32_p50_s)} / {_pct(s.prefix_hit_rate)}"
            )
        rows.append("| " + " | ".join(cells) + " |")
    return [f"### `{name}` by group", "", *_table(header, rows)]
