"""`pdd` command line: the composition root.

Each subcommand parses its own flags in the module that owns it and returns an exit code.
Heavy modules are imported lazily, so `pdd router` never loads torch or vLLM.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function); the function takes argv (list[str]) and returns an int.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("pdd.launch", "main", "start a whole local topology (router + workers)"),
    "router": ("pdd.router.main", "main", "run the OpenAI-compatible router"),
    "worker": ("pdd.launch.worker", "main", "run one worker process (any role) from a config"),
    "prefill": ("pdd.launch.worker", "main_prefill", "run a Prefill worker"),
    "relay-decode": ("pdd.launch.worker", "main_relay_decode", "run a RelayDecode worker"),
    "main-decode": ("pdd.launch.worker", "main_main_decode", "run a MainDecode worker"),
    "model": ("pdd.engine.model", "main", "prepare or verify the default model"),
    "lab": ("pdd.lab.cli", "main", "two-datacenter lab: up | down | status | exec"),
    "bench": (
        "pdd.bench",
        "main",
        "benchmarks: transfer | serve | overhead | handoff-gap | recompute | kv-wait | stream-kv | agent-turns | soak | chaos-soak | dashboard | gpu-kv-copy",
    ),
    "plan": ("pdd.plan.cli", "main", "size a fleet: simulate pdd's routing over chip profiles"),
    "plan-validate": ("pdd.plan.validate", "main", "replay a bench run in the planner"),
    "profile": ("pdd.profiler", "main", "time one worker's engine and write its chip profile"),
    "status": ("pdd.router.status", "main", "the fleet as the router sees it"),
    "certs": ("pdd.certs", "main", "make a fleet's CA, certificates, worker token and API key"),
}


def _usage() -> str:
    lines = ["usage: pdd COMMAND [ARGS...]", "", "commands:"]
    for name, (_, _, help_text) in COMMANDS.items():
        lines.append(f"  {name:<14} {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pdd: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
