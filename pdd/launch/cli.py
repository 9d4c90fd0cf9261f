"""`pdd serve`: start a whole topology (workers + router), on this host or in the lab.

Lifecycle::

    load the config -> choose the sites (this host, or the lab's two datacenters: a config
      with a `lab` section runs in the lab; --placement overrides) -> check every address
      -> [lab: use the running lab, or bring it up] -> fill `auto` hosts, pick free ports
      -> write the effective config to a run folder -> start the workers, then the router
      -> wait for every ready line and a healthy /health at the URL (deadline)
      -> print "pdd ready: http://HOST:PORT/v1" (stdout; children's output goes to stderr)
      -> supervise: a child that dies is started again with backoff (pdd.launch.supervise),
         the others keep serving -> on SIGINT/SIGTERM, or when a child failed to start
         `launch.max_failed_starts` times in a row: stop every child
      -> [lab: take it down if this launcher brought it up]

Exit status: 0 after a signal when every child stopped cleanly; 1 when a child could not be
kept running (it failed to start too often, or died with `launch.restart: false`), exited
with an error on the way down, or the lab failed; 2 for a bad config. A failing child's last
output lines are printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path

import yaml

from pdd.config import PddConfig, load_config
from pdd.errors import ConfigError, PddError
from pdd.launch.credentials import host_private
from pdd.launch.lab_sites import LabSites, planned_sites
from pdd.launch.placement import LocalSites, Sites, place
from pdd.launch.signals import stop_event
from pdd.launch.topology import Topology

log = logging.getLogger("pdd.launch")

DEFAULT_CONFIG = "configs/local.yaml"
READY_TIMEOUT_S = 600.0
SUPERVISE_POLL_S = 0.5


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdd serve", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"topology YAML ({DEFAULT_CONFIG})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument(
        "--placement",
        choices=("auto", "local", "lab"),
        default="auto",
        help="where the processes run: lab (the two-datacenter lab), local (this host), "
        "auto (lab when the config has a `lab` section)",
    )
    ap.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S, metavar="S")
    return ap.parse_args(argv)


def wants_lab(config_path: str | None, overrides: list[str], placement: str = "auto") -> bool:
    """Whether the topology runs in the lab: asked for, or the config configures a lab."""
    if placement != "auto":
        return placement == "lab"
    if any(o.split("=", 1)[0].strip().startswith("lab.") for o in overrides):
        return True
    if config_path is None:
        return False
    raw = yaml.safe_load(Path(config_path).read_text()) or {}
    return isinstance(raw, dict) and "lab" in raw


def _choose_sites(cfg: PddConfig, in_lab: bool) -> Sites:
    """The sites to run in; checks the topology against them first (ConfigError)."""
    if not cfg.workers:
        raise ConfigError("the config has no workers")
    if not in_lab:
        sites: Sites = LocalSites(cfg)
        place(cfg, sites.sites())
        return sites
    place(cfg, planned_sites(cfg.lab))
    return LabSites(cfg.lab)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    logging.basicConfig(level=os.environ.get("PDD_LOG_LEVEL", "INFO"), stream=sys.stderr)
    try:
        cfg = load_config(args.config, args.overrides)
        sites = _choose_sites(cfg, wants_lab(args.config, args.overrides, args.placement))
    except ConfigError as exc:
        print(f"pdd serve: {exc.message}", file=sys.stderr)
        return 2
    stop = stop_event()  # SIGTERM/SIGINT; never Event.set() inside a handler (see signals)
    try:
        with sites:
            return _serve(cfg, sites, args.ready_timeout, stop)
    except ConfigError as exc:
        print(f"pdd serve: {exc.message}", file=sys.stderr)
        return 2
    except PddError as exc:
        print(f"pdd serve: {exc.message}", file=sys.stderr)
        return 1


def _serve(cfg: PddConfig, sites: Sites, ready_timeout_s: float, stop: threading.Event) -> int:
    """Start the topology in ``sites``, supervise it until a signal or a death, stop it."""
    placed = place(cfg, sites.sites(), sites.pick_port)
    if isinstance(sites, LabSites):
        placed = host_private(placed)
    with tempfile.TemporaryDirectory(prefix="pdd-serve-") as run_dir:
        topo = Topology(placed, Path(run_dir), sites.spawn_for)
        try:
            topo.start(ready_timeout_s, stop)
        except PddError as exc:
            print(f"pdd serve: {exc.message}", file=sys.stderr)
            topo.stop()
            return 1
        sys.stdout.write(f"pdd ready: {topo.url}\n")  # one write: never glued to a child line
        sys.stdout.flush()
        code = 0
        while not stop.wait(SUPERVISE_POLL_S):
            try:
                topo.supervise()
            except PddError as exc:
                print(f"pdd serve: {exc.message}", file=sys.stderr)
                code = 1
                break
        topo.stop()
        for child in topo.failed():
            if code == 0:
                print(f"pdd serve: {child.describe_failure('failed')}", file=sys.stderr)
            code = 1
        return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
