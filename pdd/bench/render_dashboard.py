"""Render the Grafana dashboard's panels to a PNG from a real run (Grafana cannot be installed
on these machines: it is not in Debian and not on PyPI).

    pdd bench dashboard --config configs/local.yaml --duration 120
    pdd bench dashboard --router http://HOST:8000 \
        --worker prefill=HOST:9101 --worker main_decode=HOST:9103 --load-cmd "pdd bench serve ..."

How: a real Prometheus (Debian's ``prometheus`` binary, unpacked into the venv on first use
like tests/deploy/install_promtool.sh does for promtool) scrapes the router and every
worker's /metrics every second while load runs; then every panel's PromQL from
``deploy/grafana/pdd-dashboard.json`` is evaluated over the run with Prometheus's
``query_range`` API (``$__rate_interval`` becomes ``--rate-interval``) and drawn with
matplotlib, one subplot per panel, in the dashboard's order. So the PNG shows exactly the
dashboard's expressions over real data; only the drawing differs from Grafana.

With ``--config`` the script starts ``pdd serve`` itself (pinning the router and worker
metrics ports); with ``--router`` and ``--worker ROLE=HOST:PORT`` it watches a running
system. Load: ``--load-cmd`` (a shell command; ``PDD_URL`` holds the router's /v1 URL) or the
built-in closed loop of multi-turn conversations (``--concurrency``, ``--duration``).
Writes the PNG (``--out``) and, with ``--data-out``, the queried series as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pdd.config import load_config
from pdd.launch import free_port
from pdd.observability.dashboard import Panel, load, panels

REPO = Path(__file__).resolve().parents[2]

SCRAPE_S = 1


def ensure_prometheus(explicit: str | None) -> str:
    """The prometheus binary: ``explicit``, on PATH, in the venv, or unpacked from Debian."""
    venv_bin = Path(sys.executable).parent
    for cand in (explicit, shutil.which("prometheus"), str(venv_bin / "prometheus")):
        if cand and os.access(cand, os.X_OK):
            return cand
    with tempfile.TemporaryDirectory() as work:
        subprocess.run(["apt-get", "download", "-q", "prometheus"], cwd=work, check=True,
                       capture_output=True)  # fmt: skip
        deb = next(Path(work).glob("prometheus_*.deb"))
        subprocess.run(["dpkg", "-x", str(deb), f"{work}/root"], check=True)
        shutil.copy2(f"{work}/root/usr/bin/prometheus", venv_bin / "prometheus")
    return str(venv_bin / "prometheus")


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200 (deadline; fails early if ``proc`` died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


class Served:
    """``pdd serve`` on pinned ports: router URL and (role, metrics address) per worker."""

    def __init__(self, config: str, overrides: list[str]):
        cfg = load_config(config, overrides)
        self.router_port = free_port()
        args = [sys.executable, "-m", "pdd.cli", "serve", "--config", config,
                "--set", f"router.port={self.router_port}"]  # fmt: skip
        for o in overrides:
            args += ["--set", o]
        self.workers: list[tuple[str, str, str]] = []  # (id, role, host:port)
        for i, w in enumerate(cfg.workers):
            port = free_port()
            args += ["--set", f"workers.{i}.metrics_port={port}"]
            self.workers.append((w.id, w.role.value, f"127.0.0.1:{port}"))
        self.url = f"http://127.0.0.1:{self.router_port}/v1"
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL)

    def wait(self, timeout_s: float) -> None:
        wait_http(self.url.removesuffix("/v1") + "/health", timeout_s, self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Prometheus:
    """A throwaway Prometheus scraping the given targets every second."""

    def __init__(self, binary: str, router: str, workers: list[tuple[str, str, str]], work: Path):
        self.port = free_port()
        groups = [{"targets": [addr], "labels": {"role": role, "worker": wid}}
                  for wid, role, addr in workers]  # fmt: skip
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "15s"},
            "scrape_configs": [
                {"job_name": "pdd-router", "honor_labels": True,
                 "static_configs": [{"targets": [router], "labels": {"role": "router"}}]},
                {"job_name": "pdd-workers", "honor_labels": True, "static_configs": groups},
            ],
        }  # fmt: skip
        (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.proc = subprocess.Popen(
            [binary, f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        params = {"query": expr, "start": start, "end": end, "step": f"{SCRAPE_S}s"}
        r = httpx.get(self.url + "/api/v1/query_range", params=params, timeout=30)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def builtin_load(url: str, duration_s: float, concurrency: int, mix: list[str]) -> int:
    """Closed-loop multi-turn conversations (each turn resends the history: prefix hits).
    ``mix``: the ``pdd`` overrides requests cycle through (``auto``, ``p_md``,
    ``p_rld_md/catch_up``, ...)."""
    stop_at = time.monotonic() + duration_s
    done = [0]

    def conversation(seed: int) -> None:
        history = f"Conversation {seed}. " + " ".join(f"fact{seed}-{i}" for i in range(400))
        turn = 0
        with httpx.Client(timeout=600) as http:
            while time.monotonic() < stop_at:
                turn += 1
                history += f"\nUser turn {turn}: " + " ".join(
                    f"q{seed}{turn}{i}" for i in range(60)
                )
                pipeline, _, handoff = mix[(seed + turn) % len(mix)].partition("/")
                body = {"prompt": history, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                        "pdd": {"pipeline": pipeline, "handoff": handoff or "auto"}}  # fmt: skip
                r = http.post(url + "/completions", json=body)
                if r.status_code == 200:
                    history += r.json()["choices"][0]["text"]
                    done[0] += 1
                if len(history) > 12000:  # stay inside max_model_len: a new conversation
                    seed += concurrency
                    history, turn = f"Conversation {seed}.", 0

    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0]


UNITS = {  # Grafana unit -> (scale, axis label)
    "s": (1.0, "s"), "percentunit": (100.0, "%"), "bps": (1e-6, "Mbit/s"),
    "reqps": (1.0, "req/s"), "ops": (1.0, "per s"), "short": (1.0, ""),
}  # fmt: skip


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legend format: ``{{label}}`` becomes the label's value ("" if absent)."""
    if not fmt:
        return ",".join(f"{k}={v}" for k, v in labels.items())
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def query_panels(prom: Prometheus, shown: list[Panel], start: float, end: float,
                 rate_interval: str) -> list[dict]:  # fmt: skip
    """Each panel's series over [start, end] (``{"title", "unit", "series": [...]}``)."""
    out = []
    for p in shown:
        series = []
        for t in p.targets:
            expr = t.expr.replace("$__rate_interval", rate_interval)
            for res in prom.query_range(expr, start, end):
                pts = [(float(ts) - start, float(v)) for ts, v in res["values"]]
                series.append({"legend": legend(t.legend, res["metric"]), "points": pts})
        out.append({"title": p.title, "unit": p.unit, "series": series})
    return out


def draw(data: list[dict], out: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = (len(data) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, data, strict=False):
        scale, label = UNITS.get(panel["unit"], (1.0, panel["unit"]))
        for s in panel["series"]:
            xs = [x for x, _ in s["points"]]
            ys = [y * scale for _, y in s["points"]]
            ax.plot(xs, ys, label=s["legend"], linewidth=1.2)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if panel["series"]:
            ax.legend(fontsize=6, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(data) :]:
        ax.axis("off")
    fig.suptitle(f"pdd dashboard (deploy/grafana/pdd-dashboard.json)  {subtitle}", fontsize=12)
    fig.supxlabel("seconds since the run started", fontsize=9)
    fig.tight_layout(rect=(0, 0.01, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="start `pdd serve --config FILE` and watch it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--router", help="watch a running router (base URL) instead")
    p.add_argument("--worker", action="append", default=[], metavar="ROLE=HOST:PORT",
                   help="a running worker's metrics address (with --router)")  # fmt: skip
    p.add_argument("--load-cmd", help="shell command that runs the load (env PDD_URL)")
    p.add_argument("--duration", type=float, default=120.0, help="built-in load: seconds")
    p.add_argument("--concurrency", type=int, default=2, help="built-in load: conversations")
    p.add_argument("--mix", default="auto", help="built-in load: pipeline[/handoff] list the "
                   "requests cycle through, e.g. auto,p_rld_md/catch_up (mode pdd only)")  # fmt: skip
    p.add_argument("--rate-interval", default="15s", help="what $__rate_interval becomes")
    p.add_argument("--prometheus", help="prometheus binary (default: venv, else Debian's)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(REPO / "docs" / "dashboard.png"))
    p.add_argument("--data-out", help="also write the queried series here (JSON)")
    args = p.parse_args(argv)
    if bool(args.config) == bool(args.router):
        p.error("give --config (start a system) or --router (watch a running one)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    binary = ensure_prometheus(args.prometheus)
    served = Served(args.config, args.set) if args.config else None
    with tempfile.TemporaryDirectory(prefix="pdd-dashboard-") as work:
        prom = None
        try:
            if served is not None:
                served.wait(args.ready_timeout)
                url, workers = served.url, served.workers
            else:
                url = args.router.rstrip("/").removesuffix("/v1") + "/v1"
                workers = [(f"w{i}", *w.split("=", 1)) for i, w in enumerate(args.worker)]
            router = url.removeprefix("http://").removesuffix("/v1")
            prom = Prometheus(binary, router, workers, Path(work))
            wait_http(prom.url + "/-/ready", 60, prom.proc)
            time.sleep(3 * SCRAPE_S)  # a few samples before the load: rates start at zero
            start = time.time()
            if args.load_cmd:
                subprocess.run(args.load_cmd, shell=True, check=True,
                               env=dict(os.environ, PDD_URL=url))  # fmt: skip
                what = args.load_cmd
            else:
                n = builtin_load(url, args.duration, args.concurrency, args.mix.split(","))
                what = f"{n} requests, {args.concurrency} conversations"
            time.sleep(3 * SCRAPE_S)
            end = time.time()
            data = query_panels(prom, panels(load()), start - 3, end, args.rate_interval)
        finally:
            if prom is not None:
                prom.stop()
            if served is not None:
                served.stop()
    out = Path(args.out)
    if args.data_out:
        Path(args.data_out).write_text(json.dumps(data))
    label = args.config or args.router
    draw(data, out, f"{label}: {what}, {end - start:.0f} s")
    print(f"wrote {out} ({sum(bool(d['series']) for d in data)}/{len(data)} panels with data)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
