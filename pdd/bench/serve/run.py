"""One benchmark run: generate the workloads once, run them against every mode, write reports.

Modes run one after another (never two systems at once on a small host). A mode that cannot
start or cannot serve a workload is recorded with its error and the run goes on; the report
is always written.
"""

from __future__ import annotations

import asyncio
import platform
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from pdd.bench.serve.build import build_workload
from pdd.bench.serve.config import BenchConfig, ModeConfig
from pdd.bench.serve.metrics import cost_per_hour
from pdd.bench.serve.report import write_report
from pdd.bench.serve.results import ModeResult, WorkloadResult
from pdd.bench.serve.runner import run_mode
from pdd.bench.serve.systems import mode_workers, open_system
from pdd.bench.serve.tokens import TokenModel, load_token_model
from pdd.bench.serve.workload import Workload
from pdd.config import ModelConfig, load_config
from pdd.errors import PddError


def model_folder(cfg: BenchConfig) -> Path:
    """Where the tokenizer comes from: the first started topology's model, else the default."""
    for mode in cfg.modes:
        if mode.config is not None:
            return load_config(mode.config, list(mode.overrides)).model.resolved_path()
    return ModelConfig().resolved_path()


def build_workloads(cfg: BenchConfig, tokens: TokenModel) -> dict[str, Workload]:
    return {name: build_workload(name, cfg, tokens) for name in cfg.workloads}


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run_one_mode(
    cfg: BenchConfig,
    mode: ModeConfig,
    workloads: dict[str, Workload],
    workers: dict[str, int],
    out: Path,
) -> ModeResult:
    """Start (or reach) one mode, run every workload on it, stop it."""
    cost = cost_per_hour(workers, cfg.cost.per_hour)
    result = ModeResult(mode.name, workers, cost)
    system = open_system(mode, cfg.serve_ready_timeout_s, out)
    t0 = time.monotonic()
    try:
        _log(f"mode {mode.name}: starting" if mode.config else f"mode {mode.name}: {mode.url}")
        result.url = system.start()
        _log(f"mode {mode.name}: ready at {result.url} after {time.monotonic() - t0:.1f}s")
        phases = asyncio.run(
            run_mode(cfg, result.url, workloads, mode.name, api_key=system.api_key)
        )
        for name, wl in workloads.items():
            hits = {g.name: g.hit for g in wl.groups}
            result.workloads[name] = WorkloadResult.build(name, phases[name], hits, cfg.sla, cost)
    except PddError as exc:
        result.error = exc.message
        _log(f"mode {mode.name} failed: {exc.message}")
    finally:
        system.stop()
    _log(f"mode {mode.name}: done in {time.monotonic() - t0:.1f}s, {result.errors()} errors")
    return result


def run_benchmark(
    cfg: BenchConfig, out: Path, argv: list[str]
) -> tuple[list[ModeResult], list[Path]]:
    """The whole run. Raises ConfigError (bad config, trace, costs) before anything starts."""
    started = datetime.now().astimezone()
    tokens = load_token_model(cfg.tokenizer, model_folder(cfg), cfg.tokens_per_word)
    workloads = build_workloads(cfg, tokens)
    workers = {m.name: mode_workers(m, cfg.cost) for m in cfg.modes}
    for name, w in workers.items():
        cost_per_hour(w, cfg.cost.per_hour)  # unknown kinds fail now, not after a long run
        _log(f"mode {name}: workers {w or 'unknown (no cost)'}")
    for name, wl in workloads.items():
        measured = sum(not r.warmup for r in wl.requests)
        _log(f"workload {name}: {len(wl.requests)} requests ({measured} measured)")
    out.mkdir(parents=True, exist_ok=True)
    results = [run_one_mode(cfg, m, workloads, workers[m.name], out) for m in cfg.modes]
    meta: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "duration_s": round((datetime.now().astimezone() - started).total_seconds(), 1),
        "argv": argv,
        "token_model": tokens.name,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    return results, write_report(out, cfg, workloads, results, meta)
