"""Greedy agreement of p_md when MD's KV dtype differs from P's (issue 15, "when the precision
changes"): the exactness suite's 20 prompts through `pdd serve --config configs/local.yaml`
with MD's or P's engine changed, against a colocated vLLM run of MD's own configuration (and,
for comparison, of P's). Prints one JSON line: per oracle, the share of equal token positions,
the prompts identical, and the median first divergence.

    .venv/bin/python scripts/kv_dtype_agreement.py kv_cache_dtype=fp8_e4m3 [MAX_TOKENS]
    .venv/bin/python scripts/kv_dtype_agreement.py dtype=bfloat16          # MD in bfloat16
    .venv/bin/python scripts/kv_dtype_agreement.py p.dtype=bfloat16        # P in bfloat16
    .venv/bin/python scripts/kv_dtype_agreement.py dtype=bfloat16 32 serial

``serial`` sends the prompts one at a time, as the oracles run them (by default 4 clients at
once, as a server meets them): a bfloat16 engine's figures depend on what it batches.

Each KEY=VALUE is one of MD's engine settings (workers.2.engine.KEY), p.KEY=VALUE one of P's
(workers.0.engine.KEY, RLD's too), and each is one of that side's oracle's vLLM arguments.
Takes ~3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd.config import ModelConfig  # noqa: E402
from pdd.router.text.tokenizer import TextCodec  # noqa: E402
from tests.e2e.test_pdd_local import (  # noqa: E402
    COMMON,
    CONFIG,
    DTYPE,
    WORKERS,
    build_prompts,
    complete,
)
from tests.helpers import at_once, run_oracle, serve, stop  # noqa: E402


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    equal = total = identical = 0
    firsts = []
    for g, w in zip(got, want, strict=True):
        n = min(len(g), len(w))
        same = [a == b for a, b in zip(g[:n], w[:n], strict=True)]
        equal, total = equal + sum(same), total + max(len(g), len(w))
        identical += g == w
        firsts.append(same.index(False) if False in same else n)
    return {
        "positions_equal": round(equal / total, 4),
        "prompts_identical": f"{identical}/{len(got)}",
        "median_first_divergence": statistics.median(firsts),
    }


def main() -> None:
    settings = [a for a in sys.argv[1:] if "=" in a]
    serial = "serial" in sys.argv[1:]  # one request at a time, as the oracles run them
    max_tokens = int(next((a for a in sys.argv[1:] if "=" not in a and a != "serial"), 32))
    pairs = [(k, v) for k, _, v in (s.partition("=") for s in settings)]
    engine = {k: v for k, v in pairs if not k.startswith("p.")}
    p_engine = {k[2:]: v for k, v in pairs if k.startswith("p.")}
    codec = TextCodec.from_folder(ModelConfig(dtype=DTYPE).resolved_path())
    prompts = build_prompts(codec)
    runs = [{"prompt_token_ids": p} for p in prompts]
    own = run_oracle(runs, DTYPE, max_tokens, engine=engine)
    ps = run_oracle(runs, DTYPE, max_tokens, engine=p_engine)
    sets = [f"workers.{WORKERS.index('md')}.engine.{k}={v}" for k, v in engine.items()]
    sets += [f"workers.{WORKERS.index(w)}.engine.{k}={v}"
             for w in ("p", "rld") for k, v in p_engine.items()]  # fmt: skip
    served = serve(CONFIG, WORKERS, [*COMMON, *sets])
    try:
        bodies = at_once(
            lambda p: complete(served.url, p, {"pipeline": "p_md"}, max_tokens=max_tokens),
            prompts,
            clients=1 if serial else 4,
        )
    finally:
        stop(served)
    # Positions of the texts re-tokenized the same way on both sides (the API returns text).
    got = [codec.encode(b["choices"][0]["text"]) for b in bodies]
    own_t, ps_t = ([codec.encode(codec.decode(o["token_ids"])) for o in x] for x in (own, ps))
    print(json.dumps({
        "md_engine": engine, "p_engine": p_engine, "max_tokens": max_tokens, "serial": serial,
        "prompts": len(prompts),
        "vs_md_own_configuration": agreement(got, own_t),
        "vs_p_configuration": agreement(got, ps_t),
        "md_own_vs_p": agreement(own_t, ps_t),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
