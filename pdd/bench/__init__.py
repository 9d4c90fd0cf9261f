"""`pdd bench ...`: benchmarks that write JSON and plots. Each subcommand owns its module."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help); the module's main(argv) returns an exit code.
BENCHES: dict[str, tuple[str, str]] = {
    "transfer": ("pdd.bench.transfer", "KV transports against raw socket / raw ucxx baselines"),
    "serve": ("pdd.bench.serve", "serving benchmark: agentic / sweep / trace across modes"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        names = "\n".join(f"  {n:<10} {h}" for n, (_, h) in BENCHES.items())
        print(f"usage: pdd bench NAME [ARGS...]\n\nbenchmarks:\n{names}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:]) or 0)
