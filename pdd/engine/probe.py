"""`python -m pdd.engine.probe [--set k=v ...]`: measure one engine on this machine, print JSON.

Starts one Engine from config (defaults: the default model), then measures: time to ready,
resident memory of this process and of the engine-core child, prefill throughput on a cold
prompt, TTFT on the same prompt once it is prefix-cached, and greedy decode throughput at
batch 1 and batch 8. Numbers are medians of ``--repeat`` runs. Used for docs/notes/engine.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import psutil

from pdd.config import load_config
from pdd.engine.types import SamplingSpec


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 40000 + 100 for i in range(n)]


async def _timed(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, total_s, tokens) of one greedy request."""
    spec = SamplingSpec(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.monotonic()
    ttft, n = 0.0, 0
    async for d in engine.generate(rid, prompt, spec):
        if n == 0:
            ttft = time.monotonic() - started
        n += len(d.token_ids)
    return ttft, time.monotonic() - started, n


async def _decode_rate(engine, batch: int, tokens: int, salt: int) -> float:
    """Generated tokens per second with ``batch`` concurrent requests, after their first token."""
    runs = await asyncio.gather(
        *(_timed(engine, f"b{salt}-{i}", _prompt(16, salt * 100 + i), tokens) for i in range(batch))
    )
    decode_s = max(total for _, total, _ in runs) - min(ttft for ttft, _, _ in runs)
    return sum(n - 1 for _, _, n in runs) / decode_s


async def _probe(cfg, prompt_len: int, repeat: int) -> dict:
    from pdd.engine.engine import Engine

    engine = Engine(cfg.model, cfg.engine)
    await engine.start()
    try:
        me = psutil.Process()
        core = [c for c in me.children(recursive=True) if c.name().startswith("VLLM")]
        await _timed(engine, "warmup", _prompt(64, 999), 4)
        prefill, cached, b1, b8 = [], [], [], []
        for r in range(repeat):
            cold = _prompt(prompt_len, r)
            ttft, _, _ = await _timed(engine, f"cold{r}", cold, 1)
            prefill.append(prompt_len / ttft)
            cached.append((await _timed(engine, f"warm{r}", cold, 1))[0])
            b1.append(await _decode_rate(engine, 1, 128, 10 + r))
            b8.append(await _decode_rate(engine, 8, 64, 20 + r))
        return {
            "dtype": cfg.model.dtype,
            "startup_s": round(engine.startup_s or 0, 2),
            "rss_frontend_mib": me.memory_info().rss >> 20,
            "rss_engine_core_mib": sum(c.memory_info().rss for c in core) >> 20,
            "kv_cache_gib": cfg.engine.kv_cache_space_gib,
            "prompt_tokens": prompt_len,
            "prefill_tok_s": round(statistics.median(prefill)),
            "cached_ttft_ms": round(statistics.median(cached) * 1000, 1),
            "decode_tok_s_batch1": round(statistics.median(b1), 1),
            "decode_tok_s_batch8": round(statistics.median(b8), 1),
            "cpu_count": psutil.cpu_count(),
            "load_avg_1m": round(psutil.getloadavg()[0], 2),
        }
    finally:
        await engine.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdd.engine.probe", description=__doc__)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    print(json.dumps(asyncio.run(_probe(cfg, args.prompt_tokens, args.repeat))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
