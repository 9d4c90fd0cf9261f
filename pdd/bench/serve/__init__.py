"""`pdd bench serve`: the serving benchmark (issue 5).

Generates deterministic workloads (agentic multi-turn traffic with PDD's skewed prefix-hit
distribution, a hit-rate sweep for the bathtub curve, replay of a JSONL trace), offers them to
each mode (a running endpoint, or a topology started with `pdd serve`) as streamed chat
completions, and reports TTFT / TPOT / ITL / stalls / E2E, SLA goodput, WAN bytes, DRC hit
rate, RLD share, handoffs and BCR as JSON, markdown and PNG plots.

Modules, bottom up:

- ``words`` / ``tokens`` / ``text``   vocabulary, token arithmetic, exact-length prompt surgery
- ``workload``                        typed requests and phases; ``agentic``, ``sweep``, ``trace``
                                      generate them; ``build`` picks one by name
- ``client``                          one streamed request -> ``RequestRecord``
- ``runner``                          phases, open/closed loop, ordering, deadlines, progress
- ``metrics`` / ``results``           percentiles, TPOT, goodput, BCR; per-phase summaries
- ``systems``                         endpoint, or `pdd serve` as an owned child process
- ``report`` / ``plots``              results.json, requests.jsonl, report.md, PNGs
- ``config`` / ``run`` / ``cli``      the config model, one run, the command line
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    """Entry point for `pdd bench serve ARGS...` (argv excludes the subcommand words)."""
    from pdd.bench.serve.cli import main as cli_main

    return cli_main(list(argv))
