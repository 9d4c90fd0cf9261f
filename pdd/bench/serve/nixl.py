"""The `vllm_nixl` mode: vLLM's own prefill/decode flow, the real peer, on the same topology.

From a pdd topology config it takes the first prefill and the first main_decode worker (their
engine settings, datacenters and the lab) and runs, in those sites::

    P      `vllm serve` with NixlConnector (kv_producer, KV in host memory)   in P's datacenter
    D      the same as kv_consumer, in D's datacenter (across the lab's WAN from P)
    proxy  pdd.bench.serve.nixl_proxy, next to P (where pdd's router runs): the client's
           endpoint; P prefills for one token and keeps the blocks, D pulls the blocks its own
           prefix cache lacks from P (NIXL READ over UCX/TCP) and streams every token

Lifecycle: ``start()`` enters the sites (a lab that is down is brought up, and taken down by
``stop()``), spawns P, D and the proxy, and waits for the proxy's /health (200 once P and D
answer); ``stop()`` ends every process group and is safe to call more than once. Each child's
output goes to ``serve-<mode>-{p,d,proxy}.log`` in the results folder; every child gets
PR_SET_PDEATHSIG, so it goes down with the benchmark however that ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdd.bench.serve.config import ModeConfig
from pdd.bench.serve.nixl_progress import ENV as PROGRESS_ENV
from pdd.config import PddConfig, load_config
from pdd.config.model import EngineConfig
from pdd.engine.env import omp_env, update_env
from pdd.engine.model import prepare_model
from pdd.errors import ConfigError, PddError
from pdd.lab.plan import WAN_IFNAME
from pdd.launch import child_env, die_with_parent
from pdd.launch.cli import wants_lab
from pdd.launch.lab_sites import LabSites
from pdd.launch.placement import LocalSites, Site, Sites, router_datacenter
from pdd.protocol import Role

GiB = 1 << 30
STOP_GRACE_S = 30.0
# P produces KV, D consumes it; the KV stays in host memory (this platform's only choice)
KV_ROLES = {"p": "kv_producer", "d": "kv_consumer"}


@dataclass(frozen=True)
class Engine:
    """One `vllm serve` of the pair: where it runs and what it binds."""

    name: str  # p | d
    site: Site
    engine: EngineConfig
    port: int
    side_channel_port: int  # NIXL's handshake listener (VLLM_NIXL_SIDE_CHANNEL_PORT)

    @property
    def host(self) -> str:
        return self.site.worker_host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def pair_workers(topo: PddConfig) -> tuple[str, str]:
    """The ids of the topology's first prefill and first main_decode worker. Raises
    ConfigError when it lacks either."""

    def first(role: Role) -> str:
        for w in topo.workers:
            if w.role is role:
                return w.id
        raise ConfigError(f"vllm_nixl needs a {role.value} worker in the topology")

    return first(Role.PREFILL), first(Role.MAIN_DECODE)


def kv_transfer_config(name: str) -> dict[str, str]:
    return {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[name], "kv_buffer_device": "cpu"}


def vllm_argv(topo: PddConfig, e: Engine, model_path: Path) -> list[str]:
    """`vllm serve` with the worker's engine settings (as pdd's engine passes them to vLLM).
    The step budget only where configured: vLLM's P sends its KV after the whole prefill, so
    the budget pdd's streaming P takes by default on a GPU (``Engine.step_tokens``) does not
    apply, and vLLM keeps its own (the same as pdd's on CPU)."""
    c = e.engine
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path), "--served-model-name", topo.model.name,
        "--dtype", c.dtype or topo.model.dtype,
        "--max-model-len", str(c.max_model_len), "--block-size", str(c.block_size),
        "--max-num-seqs", str(c.max_num_seqs), "--seed", str(c.seed),
        "--kv-cache-memory-bytes", str(int(c.kv_cache_space_gib * GiB)),
        "--host", e.host, "--port", str(e.port),
        "--no-enable-log-requests", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(kv_transfer_config(e.name)),
    ]  # fmt: skip
    if c.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(c.max_num_batched_tokens)]
    if c.enforce_eager:
        argv.append("--enforce-eager")
    if not c.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    return argv


def vllm_env(e: Engine, in_lab: bool, progress_delay_us: int) -> dict[str, str]:
    """The child's environment: pdd's engine placement (one engine core, in process, on the
    worker's CPUs), NIXL's side channel on the worker's address, UCX on the path to the peer."""
    env = child_env()
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes decides
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_HOST_IP=e.host,
        VLLM_NIXL_SIDE_CHANNEL_HOST=e.host,
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(e.side_channel_port),
        ONEDNN_PRIMITIVE_CACHE_CAPACITY="0",  # as pdd.engine.env sets for pdd's engines
        # what vLLM's NIXL module sets itself when it imports NIXL first (here
        # pdd.bench.serve.nixl_progress may)
        UCX_RCACHE_MAX_UNRELEASED="1024",
        # the lab: TCP on the WAN device (the datacenters reach each other only there);
        # one host: shared memory, TCP on loopback
        UCX_TLS="tcp,self" if in_lab else "self,sm,tcp",
        UCX_NET_DEVICES=WAN_IFNAME if in_lab else "lo",
        **{PROGRESS_ENV: str(progress_delay_us)},
    )
    update_env(omp_env(e.engine.omp_threads_bind, multiproc=False), env)
    return env


class VllmNixl:
    """vLLM's P/D flow with NixlConnector on a topology's P and MD sites (see the module doc)."""

    def __init__(self, mode: ModeConfig, ready_timeout_s: float, results: Path):
        assert mode.config is not None
        self.mode = mode
        self.ready_timeout_s = ready_timeout_s
        self.results = results
        self.api_key: str | None = None
        self._sites: Sites | None = None
        self._procs: list[tuple[str, subprocess.Popen]] = []

    def log_path(self, name: str) -> Path:
        return self.results / f"serve-{self.mode.name}-{name}.log"

    def start(self) -> str:
        assert self.mode.config is not None
        overrides = list(self.mode.overrides)
        topo = load_config(self.mode.config, overrides)
        in_lab = wants_lab(str(self.mode.config), overrides)
        model_path = prepare_model(topo.model)
        sites: Sites = LabSites(topo.lab) if in_lab else LocalSites(topo)
        sites.__enter__()
        self._sites = sites
        try:
            return self._start(topo, sites, in_lab, model_path)
        except BaseException:
            self.stop()
            raise

    def _start(self, topo: PddConfig, sites: Sites, in_lab: bool, model_path: Path) -> str:
        where = sites.sites()
        engines = []
        for name, wid in zip(("p", "d"), pair_workers(topo), strict=True):
            worker = next(w for w in topo.workers if w.id == wid)
            site = where[worker.datacenter]
            port, side = (sites.pick_port(site.dc, site.worker_host) for _ in range(2))
            engines.append(Engine(name, site, topo.engine_for(wid), port, side))
        for e in engines:
            env = vllm_env(e, in_lab, self.mode.nixl_progress_delay_us)
            self._spawn(sites, e.site.dc, e.name, vllm_argv(topo, e, model_path), env)
        p, d = engines
        proxy_site = where[router_datacenter(topo)]
        proxy_port = sites.pick_port(proxy_site.dc, proxy_site.router_host)
        proxy = [
            sys.executable, "-m", "pdd.bench.serve.nixl_proxy", "--prefill", p.url,
            "--decode", d.url, "--host", proxy_site.router_host, "--port", str(proxy_port),
        ]  # fmt: skip
        self._spawn(sites, proxy_site.dc, "proxy", proxy, child_env())
        url = f"http://{proxy_site.url_host}:{proxy_port}"
        self._wait_ready(url)
        return url + "/v1"

    def _spawn(self, sites: Sites, dc: str, name: str, argv: list[str], env: dict) -> None:
        with self.log_path(name).open("w", encoding="utf-8") as log:
            proc = sites.spawn_for(dc)(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
        self._procs.append((name, proc))

    def _wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise PddError(
                        f"mode {self.mode.name}: {name} exited with {proc.returncode} "
                        f"(log {self.log_path(name)}):\n    {_tail(self.log_path(name))}"
                    )
            with contextlib.suppress(httpx.HTTPError):
                resp = httpx.get(url + "/health", timeout=5)
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            time.sleep(1.0)
        raise PddError(f"mode {self.mode.name}: not ready in {self.ready_timeout_s:.0f}s ({last})")

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for _, proc in reversed(procs):  # the proxy first, then D, then P
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for _, proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)  # what is left of the group (engine cores)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        sites, self._sites = self._sites, None
        if sites is not None:
            sites.__exit__(None, None, None)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n    ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
