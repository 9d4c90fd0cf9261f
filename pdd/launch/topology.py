"""The children of one `pdd serve`: built from a placed config, started, checked, stopped.

Lifecycle::

    write the effective config -> spawn every worker -> wait for each ready line
      -> spawn the router -> wait for its ready line
      -> poll the router's /health at the printed URL until it reports every worker healthy
      -> (supervised by the caller: ``supervise`` restarts dead children, see
         pdd.launch.supervise) -> stop: router first (it stops taking requests), then
         every worker at once (SIGTERM; SIGKILL after the grace period)

A child that dies while the topology starts is restarted the same way, until it failed to
start ``launch.max_failed_starts`` times in a row.

The /health check goes the way a client goes (from this host, through the management link
in the lab) and proves the router reaches every worker over its own links.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from pdd.errors import PddError
from pdd.launch.children import Child, child_env, child_specs
from pdd.launch.credentials import with_run_credentials
from pdd.launch.placement import Placed, Spawn
from pdd.launch.supervise import GaveUp, Supervisor

log = logging.getLogger("pdd.launch")

# SIGTERM to SIGKILL, per stage (router, then all workers). A worker needs ~4-11 s: vLLM gives
# its engine core 10 s to exit before it kills it, and on loaded cores that happens.
STOP_GRACE_S = 30.0
HEALTH_POLL_S = 0.25
HEALTH_TIMEOUT_S = 2.0
# No proxy: the router is on this host or behind a management link, never behind a proxy.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Topology:
    """Owns the child processes of one placed topology."""

    def __init__(self, placed: Placed, run_dir: Path, spawn_for: Callable[[str], Spawn]):
        self.placed = placed
        self.config_path = run_dir / "effective-config.yaml"
        data = with_run_credentials(placed.cfg.model_dump(mode="json"), run_dir)
        self.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        specs = child_specs(placed.cfg, self.config_path, placed.router_dc)
        self.children = [Child(spec, spawn_for(spec.dc)) for spec in specs]
        self.supervisor = Supervisor(self.children, placed.cfg.launch, child_env())

    @property
    def url(self) -> str:
        return self.placed.url

    @property
    def workers(self) -> list[Child]:
        return self.children[:-1]

    @property
    def router(self) -> Child:
        return self.children[-1]

    def start(self, timeout_s: float, cancel: threading.Event) -> None:
        """Start the workers, wait until all are ready, then the router (so its first health
        poll already sees them), then wait for a healthy fleet. Raises PddError when a child
        fails, the deadline passes or ``cancel`` is set."""
        env = self.supervisor.env
        deadline = time.monotonic() + timeout_s
        for child in self.workers:
            child.start(env)
        self._wait_ready(self.workers, deadline, cancel)
        self.router.start(env)
        self._wait_ready([self.router], deadline, cancel)
        self._wait_healthy(deadline, cancel)

    def _wait_ready(self, children: list[Child], deadline: float, cancel: threading.Event) -> None:
        for child in children:
            while not child.ready.wait(timeout=0.2):
                self._check(deadline, cancel)
                if time.monotonic() > deadline:
                    raise PddError(child.describe_failure("was not ready before the deadline"))

    def _wait_healthy(self, deadline: float, cancel: threading.Event) -> None:
        url = self.url.removesuffix("/v1") + "/health"
        last = "no answer yet"
        while True:
            ok, last = _health(url)
            if ok:
                return
            self._check(deadline, cancel)
            if time.monotonic() > deadline:
                raise PddError(f"{url} did not report every worker healthy in time: {last}")
            cancel.wait(HEALTH_POLL_S)

    def _check(self, deadline: float, cancel: threading.Event) -> None:
        if cancel.is_set():
            raise PddError("interrupted before every process was ready")
        self.supervise()

    def supervise(self) -> None:
        """One round of restarts (main thread). Raises PddError when the policy gives up on a
        child (it failed to start too often, or restarts are off)."""
        try:
            self.supervisor.tick()
        except GaveUp as exc:
            raise PddError(exc.message) from None

    def stop(self, grace_s: float | None = None) -> None:
        """Router first, then every worker at once; each gets ``grace_s`` (default
        STOP_GRACE_S) before SIGKILL."""
        grace_s = STOP_GRACE_S if grace_s is None else grace_s
        began = time.monotonic()
        self.router.terminate()
        self.router.wait_or_kill(began + grace_s)
        routed = time.monotonic()
        for child in self.workers:
            child.terminate()
        for child in self.workers:
            child.wait_or_kill(routed + grace_s)
        log.info(
            "stopped: router in %.1f s, workers in %.1f s%s", routed - began,
            time.monotonic() - routed, "".join(f"; {c.name} killed" for c in self.children if c.killed),
        )  # fmt: skip

    def failed(self) -> list[Child]:
        """Children that exited with an error of their own (not those already dead and
        waiting for their restart: their death was reported when it happened)."""
        return [c for c in self.children if c.failed() and not self.supervisor.pending(c)]


def _health(url: str) -> tuple[bool, str]:
    """(every worker healthy, what was seen): GET /health once."""
    try:
        with _HTTP.open(url, timeout=HEALTH_TIMEOUT_S) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}: {exc.read()[:300]!r}"
    except (OSError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    sick = [w.get("id") for w in body.get("workers", []) if not w.get("healthy")]
    if sick:
        return False, f"workers not healthy yet: {sick}"
    return True, "ok"
