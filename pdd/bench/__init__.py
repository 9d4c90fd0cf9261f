"""`pdd bench ...`: every benchmark of pdd (the one home of them), each writing JSON and plots.
Each subcommand owns its module; ``loadgen`` is the closed-loop load the small ones share."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help); the module's main(argv) returns an exit code.
BENCHES: dict[str, tuple[str, str]] = {
    "transfer": ("pdd.bench.transfer", "KV transports against raw socket / raw ucxx baselines"),
    "serve": ("pdd.bench.serve", "serving benchmark: agentic / sweep / trace / turns across modes"),
    "codec": ("pdd.bench.codec", "WAN KV codecs on real KV: wire ratio, GB/s per core, quality"),
    "overhead": ("pdd.bench.serve_overhead", "pdd's router + worker vs vLLM's own OpenAI server"),
    "handoff-gap": ("pdd.bench.handoff_gap", "stalls around One-Shot / Catch-Up handoffs"),
    "recompute": ("pdd.bench.recompute", "MD computing a miss or waiting for it, per WAN rate"),
    "stream-kv": ("pdd.bench.stream_kv", "cold prompts: KV streamed while P prefills vs after"),
    "kv-wait": ("pdd.bench.kv_wait", "p_md: MD's Generate waiting for its KV vs AwaitKv first"),
    "agent-turns": ("pdd.bench.agent_turns", "short agent turns: MD learning the prefix"),
    "soak": ("pdd.bench.soak", "mixed traffic + paused workers: leaks, memory, failures"),
    "chaos-soak": (
        "pdd.bench.chaos_soak",
        "every pipeline under WAN chaos and killed workers: answers checked, leaks, restarts",
    ),
    "dashboard": ("pdd.bench.render_dashboard", "render the Grafana dashboard's panels to a PNG"),
    "gpu-kv-copy": ("pdd.bench.gpu_kv_copy", "the torch KV block copier on a GPU (or --smoke)"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        names = "\n".join(f"  {n:<12} {h}" for n, (_, h) in BENCHES.items())
        print(f"usage: pdd bench NAME [ARGS...]\n\nbenchmarks:\n{names}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:]) or 0)
