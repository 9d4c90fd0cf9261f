"""Build a named workload (agentic, sweep, trace, turns) from the bench config.

Above the generators and ``workload`` (the types they share): workload -> generators -> build,
no circle.
"""

from __future__ import annotations

from pdd.bench.serve.agentic import generate_agentic
from pdd.bench.serve.config import BenchConfig
from pdd.bench.serve.sweep import generate_sweep
from pdd.bench.serve.tokens import TokenModel
from pdd.bench.serve.trace import load_trace
from pdd.bench.serve.turns import generate_turns
from pdd.bench.serve.workload import Workload


def build_workload(name: str, cfg: BenchConfig, tokens: TokenModel) -> Workload:
    """Generate one named workload from the config (deterministic in ``cfg.seed``)."""
    if name == "agentic":
        wl = generate_agentic(cfg.agentic, tokens, cfg.seed)
    elif name == "sweep":
        wl = generate_sweep(cfg.sweep, tokens, cfg.seed)
    elif name == "trace":
        assert cfg.trace.path is not None  # checked by BenchConfig
        wl = load_trace(cfg.trace.path, cfg.trace)
    elif name == "turns":
        wl = generate_turns(cfg.turns, tokens, cfg.seed)
    else:
        raise ValueError(f"unknown workload {name!r}")
    wl.token_model = tokens.name
    return wl
