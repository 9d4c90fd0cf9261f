"""Soak: a bounded run of mixed traffic near capacity with random faults, then a leak check.

    .venv/bin/pdd bench soak [--config configs/local.yaml] [--duration-s 300]

Starts `pdd serve` (its own ports), then for ``--duration-s`` runs ``--clients`` client
threads, each sending one request after another, drawn from a mix: short prompts without
streaming, long prompts streaming, long prompts streaming through RelayDecode (``p_rld_md``:
RLD streams first, then hands off to MD), short streams, streams the client drops after a
few chunks (a client disconnect), and bad requests (which must get a 4xx). Meanwhile a fault thread
pauses a random worker (SIGSTOP, then SIGCONT after ``--pause-s``: a hung peer or a stalled
WAN link, as seen from everything that talks to it) every ``--fault-interval-s``, and a
sampler reads every worker's resident memory (its process and the vLLM engine core under it,
from /proc: private and shared, the shared part being the KV arenas as their pages are touched).

At the end: traffic stops, every worker must come back to idle (running and waiting requests,
pinned KV slots and open transfers all 0, from each worker's /metrics) within
``--settle-s``; what is left is a leak. The private-memory slope per worker (least squares
over the samples after the first quarter of the run, MiB per minute) says whether memory stays
flat.
Writes ``OUT/soak.json``, ``OUT/soak.png`` and ``OUT/serve.log`` (the topology's output);
exit status 1 when something leaked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from pdd.config import load_config
from pdd.launch import free_port

REPO = Path(__file__).resolve().parents[2]
PAGE = os.sysconf("SC_PAGE_SIZE")
LEAK_METRICS = (
    "pdd_worker_running_requests",
    "pdd_worker_waiting_requests",
    "pdd_worker_kv_pinned_slots",
    "pdd_worker_kv_open_transfers",
)
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
MIX = (("short", 0.3), ("long_stream", 0.15), ("relay_stream", 0.15), ("short_stream", 0.15),
       ("disconnect", 0.15), ("bad", 0.1))  # fmt: skip


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdd bench soak", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--clients", type=int, default=6, help="concurrent client threads")
    ap.add_argument("--fault-interval-s", type=float, default=20.0)
    ap.add_argument("--pause-s", type=float, default=3.0, help="how long a worker is paused")
    ap.add_argument("--settle-s", type=float, default=60.0, help="time to come back to idle")
    ap.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling period")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--seeded",
        action="store_true",
        help="give sampled requests a per-request seed (seeded chunked prefill: it crashed vLLM "
        "0.32's CPU engine core until pdd.engine.vllm_plugin)",
    )
    ap.add_argument("--out", default="results/soak")
    return ap.parse_args(argv)


# --- the topology ------------------------------------------------------------------------


class Topology:
    """One `pdd serve` with known router and metrics ports; its worker pids from /proc."""

    def __init__(self, config: str, log_path: Path, overrides: tuple[str, ...] | list[str] = ()):
        cfg = load_config(config, list(overrides))
        self.worker_ids = [w.id for w in cfg.workers]
        self.metrics = {w: free_port() for w in self.worker_ids}
        port = free_port()
        args = [sys.executable, "-m", "pdd.cli", "serve", "--config", config,
                "--set", f"router.port={port}"]  # fmt: skip
        for o in overrides:
            args += ["--set", o]
        for i, w in enumerate(self.worker_ids):
            args += ["--set", f"workers.{i}.port={free_port()}"]
            args += ["--set", f"workers.{i}.metrics_port={self.metrics[w]}"]
        with log_path.open("w") as log:  # every child's output, prefixed with its name
            self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=log,
                                         text=True)  # fmt: skip
        self.log_path = log_path
        self.url = ""

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:  # the only stdout line is the ready line
            if line.startswith("pdd ready: "):
                self.url = line.split()[2]
                break
            if time.monotonic() > deadline:
                break
        if not self.url:
            self.stop()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"pdd serve was not ready; its output ends with:\n{tail}")
        self.pids = {w: _worker_pid(self.proc.pid, w) for w in self.worker_ids}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def worker_metrics(self, w: str) -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{self.metrics[w]}/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in LEAK_METRICS:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


def _tree(pid: int) -> list[int]:
    """``pid`` and every live process under it."""
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _worker_pid(serve_pid: int, worker_id: str) -> int:
    for pid in _tree(serve_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pdd.launch.worker" in argv and worker_id.encode() in argv:
            return pid
    raise RuntimeError(f"no process for worker {worker_id}")


def rss_mib(pid: int) -> tuple[float, float]:
    """(private, shared) resident MiB of a process and everything under it (the worker and its
    engine core), from /proc/PID/status RssAnon and RssShmem. Private memory is what a leak
    grows; shared memory is the KV arenas (staging, DRC host tier, landing slots), resident
    as their pages are first touched, and counted once per process that maps them."""
    anon = shmem = 0
    for p in _tree(pid):
        try:
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines()
            )
            anon += int(fields["RssAnon"].split()[0])
            shmem += int(fields["RssShmem"].split()[0])
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return anon / 1024, shmem / 1024


# --- traffic -----------------------------------------------------------------------------


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def one_request(http, url: str, model: str, kind: str, rng: random.Random, seeded: bool) -> str:
    """Send one request of ``kind``; returns its outcome label."""
    if kind == "bad":
        body = {"model": model, "prompt": "x", "max_tokens": -5}
        r = http.post(f"{url}/completions", json=body)
        return "bad_rejected" if 400 <= r.status_code < 500 else f"bad_got_{r.status_code}"
    long = kind in ("long_stream", "relay_stream")
    body = {"model": model, "prompt": _prompt(rng, 600 if long else 12),
            "max_tokens": rng.randint(16, 64), "temperature": 0.7}  # fmt: skip
    if kind == "relay_stream":  # on one host the router's policy never needs RLD: ask for it
        body["pdd"] = {"pipeline": "p_rld_md"}
    if seeded:  # vLLM 0.32 CPU: a seeded request in a chunked prefill kills the engine
        body["seed"] = rng.randint(0, 9999)
    if kind == "short":
        r = http.post(f"{url}/completions", json=body)
        return "completed" if r.status_code == 200 else f"status_{r.status_code}"
    body["stream"] = True
    with http.stream("POST", f"{url}/completions", json=body) as r:
        if r.status_code != 200:
            return f"status_{r.status_code}"
        chunks, stop_after = 0, rng.randint(1, 4) if kind == "disconnect" else None
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return "completed"
            if line.startswith("data: "):
                if '"error"' in line[:20]:
                    return "stream_error"
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    return "disconnected"  # leaving the block closes the connection
    return "stream_cut"


def client_loop(url, model, seed: int, end: float, outcomes: Counter, lock, seeded: bool,
                mix: tuple[tuple[str, float], ...]) -> None:  # fmt: skip
    rng = random.Random(seed)
    kinds, weights = zip(*mix, strict=True)
    with httpx.Client(timeout=120) as http:
        while time.monotonic() < end:
            kind = rng.choices(kinds, weights)[0]
            try:
                outcome = one_request(http, url, model, kind, rng, seeded)
            except httpx.HTTPError as exc:
                outcome = f"client_error_{type(exc).__name__}"
            with lock:
                outcomes[(kind, outcome)] += 1
            if outcome.startswith("status_429") or outcome.startswith("status_503"):
                time.sleep(1.0)  # Retry-After


def fault_loop(topo: Topology, args, end: float, events: list, stop: threading.Event) -> None:
    rng = random.Random(args.seed + 1)
    t0 = time.monotonic()
    while not stop.wait(args.fault_interval_s) and time.monotonic() + args.pause_s < end:
        w = rng.choice(topo.worker_ids)
        pid = topo.pids[w]
        os.kill(pid, signal.SIGSTOP)
        events.append({"t_s": round(time.monotonic() - t0, 1), "fault": "pause", "worker": w})
        stop.wait(args.pause_s)
        os.kill(pid, signal.SIGCONT)


def sample_loop(topo: Topology, period: float, samples: list, stop: threading.Event) -> None:
    t0 = time.monotonic()
    while True:
        row = {"t_s": round(time.monotonic() - t0, 2)}
        for w, pid in topo.pids.items():
            anon, shmem = rss_mib(pid)
            row[w], row[f"{w}.shmem"] = round(anon, 1), round(shmem, 1)
        samples.append(row)
        if stop.wait(period):
            return


# --- the report --------------------------------------------------------------------------


def slope_mib_per_min(samples: list[dict], worker: str) -> float:
    """Least-squares slope of private RSS over time, after the first quarter (warm-up)."""
    rows = samples[len(samples) // 4 :]
    return least_squares_slope([r["t_s"] / 60 for r in rows], [r[worker] for r in rows])


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    """dy/dx of the least-squares line (0 with fewer than 3 points)."""
    if len(xs) < 3:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def settle(topo: Topology, timeout_s: float) -> dict[str, dict[str, float]]:
    """Poll every worker until all leak metrics are 0 or the timeout passes; the last view."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = {w: topo.worker_metrics(w) for w in topo.worker_ids}
        if not any(v for m in view.values() for v in m.values()) or time.monotonic() > deadline:
            return view
        time.sleep(0.5)


def plot(samples: list[dict], workers: list[str], events: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for w in workers:
        ts = [r["t_s"] for r in samples]
        (line,) = ax.plot(ts, [r[w] for r in samples], label=f"{w} private")
        ax.plot(ts, [r[f"{w}.shmem"] for r in samples], ls="--", color=line.get_color(),
                label=f"{w} shared (KV arenas touched)")  # fmt: skip
    for e in events:
        ax.axvline(e["t_s"], color="grey", alpha=0.3, lw=1)
    ax.set_xlabel("time (s); grey lines: a worker paused")
    ax.set_ylabel("resident MiB, worker + engine core")
    ax.set_title("pdd soak: memory per worker")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    topo = Topology(args.config, Path(args.out) / "serve.log")
    topo.wait_ready()
    cfg = load_config(args.config)
    model = cfg.model.name
    # RelayDecode takes part only in router.mode pdd: elsewhere the override is a 400
    mix = MIX if cfg.router.mode.value == "pdd" else tuple(k for k in MIX if k[0] != "relay_stream")
    outcomes: Counter = Counter()
    samples: list[dict] = []
    events: list[dict] = []
    stop, lock = threading.Event(), threading.Lock()
    try:
        end = time.monotonic() + args.duration_s
        sampler = threading.Thread(target=sample_loop, args=(topo, args.sample_s, samples, stop))
        faults = threading.Thread(target=fault_loop, args=(topo, args, end, events, stop))
        clients = [threading.Thread(target=client_loop, args=(topo.url, model, args.seed * 100 + i,
                                                               end, outcomes, lock, args.seeded, mix))
                   for i in range(args.clients)]  # fmt: skip
        for t in (sampler, faults, *clients):
            t.start()
        for t in clients:
            t.join()
        stop.set()
        faults.join()
        final = settle(topo, args.settle_s)
        sampler.join()
    finally:
        stop.set()
        for pid in topo.__dict__.get("pids", {}).values():  # never leave a worker paused
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        serve_exit = topo.stop()
    return report(args, topo, outcomes, samples, events, final, serve_exit)


def report(args, topo, outcomes: Counter, samples, events, final, serve_exit: int) -> dict:
    by_outcome: Counter = Counter()
    for (_kind, outcome), n in outcomes.items():
        by_outcome[outcome] += n
    ok = {"completed", "disconnected", "bad_rejected"}
    leaks = {w: {k: v for k, v in m.items() if v} for w, m in final.items()}
    return {
        "config": args.config,
        "duration_s": args.duration_s,
        "clients": args.clients,
        "faults": {
            "kind": "SIGSTOP/SIGCONT of a random worker",
            "pause_s": args.pause_s,
            "count": len(events),
            "events": events,
        },  # fmt: skip
        "requests_sent": sum(outcomes.values()),
        "completed": by_outcome["completed"],
        "client_disconnects": by_outcome["disconnected"],
        "bad_requests_rejected": by_outcome["bad_rejected"],
        "failed": {k: v for k, v in by_outcome.items() if k not in ok},
        "by_kind": {f"{k}:{o}": n for (k, o), n in sorted(outcomes.items())},
        "leaks": leaks,
        "leaked": any(leaks.values()),
        "final_worker_state": final,
        "rss_mib": {
            w: {
                "first": samples[0][w],
                "last": samples[-1][w],
                "max": max(r[w] for r in samples),
                "slope_mib_per_min": round(slope_mib_per_min(samples, w), 2),
                "shared_first": samples[0][f"{w}.shmem"],
                "shared_last": samples[-1][f"{w}.shmem"],
            }
            for w in topo.worker_ids
        }
        if samples
        else {},  # fmt: skip
        "rss_samples": samples,
        "serve_exit_code": serve_exit,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    if result["rss_samples"]:
        plot(result["rss_samples"], list(result["rss_mib"]), result["faults"]["events"],
             out / "soak.png")  # fmt: skip
    summary = {k: result[k] for k in ("requests_sent", "completed", "client_disconnects",
                                      "bad_requests_rejected", "failed", "leaks", "rss_mib")}  # fmt: skip
    print(json.dumps(summary, indent=2))
    return 1 if result["leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
