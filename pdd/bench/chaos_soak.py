"""Chaos soak: every pipeline in float32 greedy while the WAN misbehaves and workers are killed,
paused and restarted at random (seeded); every completed answer is checked against a healthy
run of the same prompt.

    sudo .venv/bin/pdd bench chaos-soak [--config configs/lab.yaml]
        [--duration-s 1800] [--set lab.jitter_ms=5 ...] [--out results/chaos-soak]

1. `pdd serve` (in the lab for configs/lab.yaml: the WAN chaos comes from its `lab` section
   and ``--set lab.*``, see pdd.lab.chaos), one healthy pass over a seeded pool of prompts:
   the reference answer of each (greedy, float32: every pipeline must give exactly it).
2. For ``--duration-s``: ``--clients`` threads send prompts from the pool (p_md, p_rld_md with
   One-Shot and Catch-Up, auto; streamed or not); a fault thread every ``--fault-interval-s``
   SIGKILLs a random worker (`pdd serve` restarts it: pdd.launch.supervise) or pauses one
   (SIGSTOP for ``--pause-s``). Each answer is: correct (equal to its reference), different (a
   wrong answer: the target is 0), failed retryably (429/503, or a stream cut with an error
   event: a client can retry), or failed otherwise (the target is 0).
3. Settle: every worker back to idle (running requests, pinned KV slots and open transfers 0,
   from the router's /debug/workers: in the lab the workers' own ports are inside the
   datacenters): what is left is a leak.

Writes OUT/chaos_soak.json (counts, restarts, faults, leaks, memory slope per worker since its
last restart and over its longest stretch without a kill) and OUT/chaos_soak.png. Exit status
1 on a wrong answer, a non-retryable failure or a leak.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

import httpx

from pdd.bench.soak import (
    Topology,
    _worker_pid,
    least_squares_slope,
    plot,
    rss_mib,
    slope_mib_per_min,
)
from pdd.config import load_config

VARIANTS = ({"pipeline": "p_md"}, {"pipeline": "p_rld_md", "handoff": "one_shot"},
            {"pipeline": "p_rld_md", "handoff": "catch_up"}, {"pipeline": "auto"})  # fmt: skip
WORDS = "river stone cloud market engine garden silver window planet forest music letter".split()
RETRYABLE = ("status_429", "status_503", "stream_error")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdd bench chaos-soak", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/lab.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=24, help="size of the prompt pool")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--fault-interval-s", type=float, default=45.0)
    ap.add_argument("--kill-share", type=float, default=0.5, help="faults that are SIGKILLs")
    ap.add_argument("--pause-s", type=float, default=3.0)
    ap.add_argument("--settle-s", type=float, default=120.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default="results/chaos-soak")
    return ap.parse_args(argv)


def prompt_pool(n: int, seed: int) -> list[str]:
    """Short and long prompts (12-700 words): cold ones cross the WAN, repeats hit the DRC."""
    rng = random.Random(seed)
    return [f"Note {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.choice((12, 200, 700))))
            for i in range(n)]  # fmt: skip


def ask(http: httpx.Client, url: str, body: dict, stream: bool) -> tuple[str, str]:
    """(outcome, text): outcome is ok | status_N | stream_error | stream_cut."""
    if not stream:
        r = http.post(f"{url}/completions", json=body)
        return ("ok", r.json()["choices"][0]["text"]) if r.status_code == 200 else (
            f"status_{r.status_code}", "")  # fmt: skip
    text = []
    with http.stream("POST", f"{url}/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return f"status_{r.status_code}", ""
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return "ok", "".join(text)
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "stream_error", ""
                text += [c.get("text") or "" for c in chunk.get("choices") or []]
    return "stream_cut", ""


class Run:
    """The shared state of one soak: references, outcomes, faults, restarts."""

    def __init__(self, args: argparse.Namespace, topo: Topology, model: str) -> None:
        self.args, self.topo, self.model = args, topo, model
        self.pool = prompt_pool(args.prompts, args.seed)
        self.reference: dict[int, str] = {}
        self.outcomes: Counter = Counter()
        self.events: list[dict] = []
        self.samples: list[dict] = []
        self.restarted_at: dict[str, float] = {}
        self.lock, self.stop, self.t0 = threading.Lock(), threading.Event(), time.monotonic()

    def body(self, i: int, variant: dict) -> dict:
        return {"model": self.model, "prompt": self.pool[i], "temperature": 0, "ignore_eos": True,
                "max_tokens": self.args.max_tokens, "pdd": variant}  # fmt: skip

    def healthy_pass(self) -> None:
        with httpx.Client(timeout=300) as http:
            for i in range(len(self.pool)):
                outcome, text = ask(http, self.topo.url, self.body(i, {"pipeline": "p_md"}), False)
                if outcome != "ok":
                    raise RuntimeError(f"healthy pass: prompt {i} got {outcome}")
                self.reference[i] = text

    def client(self, seed: int, end: float) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=300) as http:
            while time.monotonic() < end:
                i = rng.randrange(len(self.pool))
                try:
                    outcome, text = ask(http, self.topo.url, self.body(i, rng.choice(VARIANTS)),
                                        rng.random() < 0.5)  # fmt: skip
                except httpx.HTTPError as exc:
                    outcome, text = f"client_error_{type(exc).__name__}", ""
                if outcome == "ok":
                    outcome = "correct" if text == self.reference[i] else "different"
                with self.lock:
                    self.outcomes[outcome] += 1
                if outcome.startswith(RETRYABLE) or outcome.startswith("client_error"):
                    time.sleep(1.0)  # Retry-After

    def faults(self, end: float) -> None:
        rng = random.Random(self.args.seed + 1)
        while not self.stop.wait(self.args.fault_interval_s) and time.monotonic() < end:
            w = rng.choice(self.topo.worker_ids)
            pid = self.pid(w)
            kill = rng.random() < self.args.kill_share
            os.kill(pid, signal.SIGKILL if kill else signal.SIGSTOP)
            self.events.append({"t_s": round(time.monotonic() - self.t0, 1),
                                "fault": "kill" if kill else "pause", "worker": w})  # fmt: skip
            if not kill:
                self.stop.wait(self.args.pause_s)
                os.kill(pid, signal.SIGCONT)

    def pid(self, w: str) -> int:
        """The worker's live pid, waiting (up to 10 minutes) while it restarts."""
        deadline = time.monotonic() + 600
        while (pid := self.refresh(w)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {w} did not come back")
            time.sleep(1.0)
        return pid

    def refresh(self, w: str) -> int | None:
        """The worker's live pid now, None while it restarts; notes when a new one appears."""
        pid = self.topo.pids[w]
        if _alive(pid):
            return pid
        try:
            new = _worker_pid(self.topo.proc.pid, w)
        except RuntimeError:
            return None
        if new == pid or not _alive(new):
            return None
        self.topo.pids[w], self.restarted_at[w] = new, time.monotonic() - self.t0
        return new

    def sample(self) -> None:
        while not self.stop.wait(self.args.sample_s):
            row = {"t_s": round(time.monotonic() - self.t0, 1)}
            for w in self.topo.worker_ids:
                pid = self.refresh(w)
                if pid is not None:  # a worker restarting has no row
                    row[w], row[f"{w}.shmem"] = (round(x, 1) for x in rss_mib(pid))
            self.samples.append(row)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def settle(url: str, timeout_s: float) -> dict[str, dict[str, int]]:
    """Poll the router's fleet view until no worker runs, pins or transfers anything (or the
    timeout passes); the last view, worker -> the non-zero counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = httpx.get(url.removesuffix("/v1") + "/debug/workers", timeout=10).json()["workers"]
        view = {
            w["id"]: {k: v for k, v in {"running": w.get("running") or 0,
                                        **(w.get("kv_plane") or {})}.items()
                      if k in ("running", "pinned_slots", "open_transfers") and v}
            for w in rows
        }  # fmt: skip
        if not any(view.values()) or time.monotonic() > deadline:
            return view
        time.sleep(1.0)


def run(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config, args.overrides)
    if cfg.model.dtype != "float32":
        raise SystemExit("chaos_soak checks exact answers: run it in float32 (model.dtype)")
    out = Path(args.out)
    topo = Topology(args.config, out / "serve.log", args.overrides)
    topo.wait_ready()
    soak = Run(args, topo, cfg.model.name)
    try:
        soak.healthy_pass()
        end = time.monotonic() + args.duration_s
        threads = [threading.Thread(target=soak.client, args=(args.seed * 100 + i, end))
                   for i in range(args.clients)]  # fmt: skip
        side = [threading.Thread(target=soak.faults, args=(end,)),
                threading.Thread(target=soak.sample)]  # fmt: skip
        for t in (*threads, *side):
            t.start()
        for t in threads:
            t.join()
        soak.stop.set()
        for t in side:
            t.join()
        for w in topo.worker_ids:
            soak.pid(w)  # a worker killed at the end is back before the leak check
        final = settle(topo.url, args.settle_s)
    finally:
        soak.stop.set()
        for pid in topo.pids.values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        serve_exit = topo.stop()
    return report(args, soak, final, serve_exit)


def steady_slopes(
    samples: list[dict], events: list[dict], workers: list[str], warmup_s: float = 60.0
) -> dict[str, dict[str, float]]:
    """Per worker, the least-squares slope of its private memory (MiB/min) over its longest
    stretch without a kill, its first ``warmup_s`` left out (a restarted engine grows while it
    starts), with the stretch's bounds: what "flat" means for a worker that is killed."""
    end = samples[-1]["t_s"] if samples else 0.0
    out = {}
    for w in workers:
        kills = sorted(e["t_s"] for e in events if e["fault"] == "kill" and e["worker"] == w)
        bounds = [0.0, *kills, end]
        start, stop = max(pairwise(bounds), key=lambda ab: ab[1] - ab[0])
        rows = [r for r in samples if start + warmup_s <= r["t_s"] < stop and w in r]
        xs, ys = [r["t_s"] / 60 for r in rows], [r[w] for r in rows]
        out[w] = {"slope": round(least_squares_slope(xs, ys), 2), "from_s": start, "to_s": stop}
    return out


def report(args, soak: Run, final: dict, serve_exit: int) -> dict:
    leaks = {w: m for w, m in final.items() if m}
    o = soak.outcomes
    failed = {k: v for k, v in o.items() if k not in ("correct", "different")}
    since = {w: [r for r in soak.samples if r["t_s"] >= soak.restarted_at.get(w, 0) and w in r]
             for w in soak.topo.worker_ids}  # fmt: skip
    return {
        "config": args.config, "overrides": args.overrides, "duration_s": args.duration_s,
        "requests_sent": sum(o.values()), "correct": o["correct"],
        "answers_different": o["different"],
        "failed_retryable": sum(v for k, v in failed.items() if k.startswith(RETRYABLE)),
        "failed_other": {k: v for k, v in failed.items() if not k.startswith(RETRYABLE)},
        "faults": soak.events,
        "kills": sum(e["fault"] == "kill" for e in soak.events),
        "restarts_seen": sorted(soak.restarted_at),
        "leaks": leaks, "leaked": any(leaks.values()),
        "slope_mib_per_min_since_last_restart": {
            w: round(slope_mib_per_min(rows, w), 2) for w, rows in since.items()},
        "slope_mib_per_min_longest_stretch": steady_slopes(
            soak.samples, soak.events, soak.topo.worker_ids),
        "rss_samples": soak.samples, "serve_exit_code": serve_exit,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (out / "chaos_soak.json").write_text(json.dumps(result, indent=2))
    if result["rss_samples"]:
        workers = [w for w in result["slope_mib_per_min_since_last_restart"]]
        plot([r for r in result["rss_samples"] if all(w in r for w in workers)], workers,
             result["faults"], out / "chaos_soak.png")  # fmt: skip
    summary = {k: v for k, v in result.items() if k not in ("rss_samples", "faults")}
    print(json.dumps(summary, indent=2))
    bad = result["answers_different"] or result["failed_other"] or result["leaked"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
