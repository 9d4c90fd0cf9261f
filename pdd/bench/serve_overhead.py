"""What pdd's router + worker add on top of vLLM: the same prompts through pdd (colocated) and
through vLLM's own OpenAI server, one after the other in one run, on the same model.

    .venv/bin/pdd bench overhead [--requests 16] [--dtypes float32 bfloat16]
        [--out results/serve_overhead]

Writes results.json (per dtype, per server, per concurrency: TTFT median, throughput, errors)
with the ratios pdd/vLLM, and, with two dtypes, what the first costs against the second (both
servers, measured in the same run), and a PNG bar chart per dtype. Target: pdd adds < 10% to
median TTFT and loses < 10% of throughput at 1 and 8 concurrent streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdd.bench.loadgen import closed_loop, summarize
from pdd.config import load_config
from pdd.engine.model import prepare_model
from pdd.launch import child_env, free_port

CONFIG = "configs/colocated.yaml"
WORDS = "river stone cloud market engine garden silver window planet forest music letter".split()


def make_bodies(model: str, n: int, prompt_words: int, max_tokens: int, seed: int) -> list[dict]:
    """Distinct prompts (a random head defeats prefix caching), fixed output length."""
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(prompt_words)]
        prompt = f"Request {i} {rng.random()}: " + " ".join(words) + ". Continue the story:"
        bodies.append(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
        )
    return bodies


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_vllm(model_dir: str, name: str, dtype: str, port: int, log) -> subprocess.Popen:
    env = child_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--served-model-name", name, "--dtype", dtype,
        "--max-model-len", "4096", "--block-size", "32", "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port), "--no-enable-log-requests",
    ]  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def start_pdd(port: int, dtype: str, log) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pdd.cli", "serve", "--config", CONFIG]
    argv += ["--set", f"router.port={port}", "--set", f"model.dtype={dtype}"]
    return subprocess.Popen(argv, env=child_env(), stdout=log, stderr=subprocess.STDOUT)


def run_server(kind: str, dtype: str, args, model: str, out: Path) -> dict:
    cfg = load_config(CONFIG, [f"model.dtype={dtype}"])
    prepare_model(cfg.model)
    port = free_port()
    with open(out / f"{kind}.log", "w") as log:
        if kind == "vllm":
            proc = start_vllm(str(cfg.model.resolved_path()), model, dtype, port, log)
        else:
            proc = start_pdd(port, dtype, log)
        health = f"http://127.0.0.1:{port}/health"
        try:
            wait_healthy(health, proc)
            base = f"http://127.0.0.1:{port}/v1"
            warm = make_bodies(model, 4, args.prompt_words, 16, seed=999)
            asyncio.run(closed_loop(base, warm, 2))
            res = {}
            for conc in args.concurrency:
                bodies = make_bodies(model, args.requests, args.prompt_words, args.max_tokens, conc)
                results, wall = asyncio.run(closed_loop(base, bodies, conc))
                res[str(conc)] = summarize(results, wall)
                print(f"{dtype} {kind} c={conc}: {json.dumps(res[str(conc)])}", flush=True)
            return res
        finally:
            stop(proc)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = list(report["vllm"].keys())
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (axes[0], "ttft_median_s", "median TTFT (ms)"),
        (axes[1], "throughput_tok_s", "throughput (output tok/s)"),
    ):
        x = range(len(concs))
        scale = 1000 if key.startswith("ttft") else 1
        ax.bar([i - 0.2 for i in x], [report["vllm"][c][key] * scale for c in concs], 0.4,
               label="vLLM OpenAI server")  # fmt: skip
        ax.bar([i + 0.2 for i in x], [report["pdd"][c][key] * scale for c in concs], 0.4,
               label="pdd (router + worker)")  # fmt: skip
        ax.set_xticks(list(x), [f"{c} streams" for c in concs])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("pdd serving overhead vs vLLM (same model, same machine, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-words", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
        help="model dtypes to measure, in this order (the first is compared with the others)",
    )  # fmt: skip
    ap.add_argument("--out", default="results/serve_overhead")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_config(CONFIG).model.name
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = {"args": vars(args), "load_before": os.getloadavg()}
    for dtype in args.dtypes:
        (out / dtype).mkdir(exist_ok=True)
        runs = {kind: run_server(kind, dtype, args, model, out / dtype) for kind in ("vllm", "pdd")}
        runs["pdd_over_vllm"] = {c: ratios(runs["pdd"][c], runs["vllm"][c]) for c in runs["vllm"]}
        report[dtype] = runs
        plot(runs, out / dtype / "serve_overhead.png")
    first = args.dtypes[0]
    report["dtype_cost"] = {
        f"{first}_over_{other}": {
            kind: {c: ratios(report[first][kind][c], report[other][kind][c]) for c in report[first][kind]}
            for kind in ("vllm", "pdd")
        }
        for other in args.dtypes[1:]
    }  # fmt: skip
    report["load_after"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({d: report[d]["pdd_over_vllm"] for d in args.dtypes}, indent=2))
    print(json.dumps(report["dtype_cost"], indent=2))
    return 0


def ratios(a: dict, b: dict) -> dict:
    """a over b: median TTFT and throughput."""
    return {
        "ttft_median_ratio": a["ttft_median_s"] / b["ttft_median_s"],
        "throughput_ratio": a["throughput_tok_s"] / b["throughput_tok_s"],
    }


if __name__ == "__main__":
    sys.exit(main())
