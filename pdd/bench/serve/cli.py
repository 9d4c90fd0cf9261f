"""`pdd bench serve`: the command line of the serving benchmark.

Exit codes: 0 every mode ran with zero failed requests; 1 a mode failed or a request failed
(the report is written anyway); 2 the configuration, a trace, an argument or the tokenizer is
invalid (nothing was started).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from pdd.bench.serve.compare import compare
from pdd.bench.serve.compare import markdown as compare_markdown
from pdd.bench.serve.config import BenchConfig, load_bench_config
from pdd.bench.serve.report import MODE_COLUMNS, mode_row
from pdd.bench.serve.results import ModeResult
from pdd.errors import ConfigError, PddError

USAGE_EXAMPLES = """examples:
  pdd bench serve --short
  pdd bench serve --config configs/bench/agentic.yaml --set load.pattern=open --set load.rate=2
  pdd bench serve --mode colocated=http://127.0.0.1:8000/v1 --workloads agentic
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="pdd bench serve",
        description="Serving benchmark: agentic, hit-rate sweep and trace workloads against "
        "each mode (colocated, pd_local, pd_wan, pdd); JSON, markdown and PNG report.",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", help="benchmark YAML (e.g. configs/bench/agentic.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--short", action="store_true", help="the ~2-minute smoke profile")
    ap.add_argument(
        "--mode",
        dest="endpoints",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="run mode NAME against a running server (replaces its config); repeatable",
    )
    ap.add_argument("--modes", help="comma-separated subset of the configured modes to run")
    ap.add_argument("--workloads", help="comma-separated: agentic,sweep,trace")
    ap.add_argument("--out", type=Path, help="results folder (default results_dir/<timestamp>)")
    return ap.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> BenchConfig:
    """Config file, then --short, then --set, then --mode/--modes/--workloads. ConfigError."""
    cfg = load_bench_config(args.config, args.overrides, short=args.short)
    data = cfg.model_dump(mode="json")
    modes = data["modes"]
    for item in args.endpoints:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise ConfigError(f"--mode expects NAME=URL, got {item!r}")
        entry = {"name": name, "url": url, "config": None, "overrides": [], "workers": {}}
        old = next((m for m in modes if m["name"] == name), None)
        if old is not None:
            entry["workers"] = old["workers"]
            modes[modes.index(old)] = entry
        else:
            modes.append(entry)
    if args.modes:
        wanted = [n.strip() for n in args.modes.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {m["name"] for m in modes})
        if unknown:
            raise ConfigError(f"--modes: unknown mode(s) {unknown}")
        data["modes"] = [m for m in modes if m["name"] in wanted]
    if args.workloads:
        data["workloads"] = [w.strip() for w in args.workloads.split(",") if w.strip()]
    try:
        return BenchConfig.model_validate(data)
    except ValueError as exc:
        raise ConfigError(f"invalid benchmark arguments: {exc}") from None


def print_summary(results: list[ModeResult], out: Path, cfg: BenchConfig) -> None:
    names: list[str] = []
    for m in results:
        names += [n for n in m.workloads if n not in names]
    for name in names:
        print(f"\n{name}:\n| {MODE_COLUMNS} |")
        for m in results:
            if name in m.workloads:
                print(mode_row(m.name, m.workloads[name].summary))
    comparison = compare(results, cfg.compare)
    if comparison is not None:
        print("\n" + "\n".join(compare_markdown(comparison)))
    for m in results:
        if m.error:
            print(f"\nmode {m.name} FAILED: {m.error}")
    print(f"\nresults: {out}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = resolve_config(args)
        out = args.out or cfg.results_dir / datetime.now().strftime("%Y%m%d-%H%M%S")
        from pdd.bench.serve.run import run_benchmark  # heavy imports only once args are fine

        results, _files = run_benchmark(cfg, out, ["pdd", "bench", "serve", *argv])
    except PddError as exc:  # config, trace, costs, tokenizer: found before any mode runs
        print(f"pdd bench serve: {exc.message}", file=sys.stderr)
        return 2
    print_summary(results, out, cfg)
    failed = any(m.error or m.errors() for m in results)
    return 1 if failed else 0
