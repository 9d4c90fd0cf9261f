"""Where the processes of `pdd serve` run and which addresses they bind.

Every worker names its datacenter (``dc-a``, ``dc-b``). The launcher maps each datacenter to a
``Site``: this host's own network namespace (every site the same, 127.0.0.1), or one namespace
of the two-datacenter lab. The router runs next to P: in the datacenter of the first prefill
worker (``dc-a`` when there is none), so router<->MD traffic crosses the WAN as in production.

A host of ``auto`` is filled from the site (an explicit address is kept and checked)::

    field                  this host     lab, datacenter D
    worker host: auto      127.0.0.1     D's WAN address: the router and the other DC reach it
                                         (its KV receiver binds and advertises it too)
    router host: auto      127.0.0.1     0.0.0.0 in D: the host reaches it at D's management
                                         address, the other DC at D's WAN address
    printed URL            router host   http://<D's management address>:PORT/v1

``place`` applies that table and refuses addresses the router (or the printed URL, from this
host) cannot reach; ``resolve_ports`` then turns every port 0 into a free port of the site.
Both are pure functions of the config and the sites. A ``Sites`` provider (``LocalSites``
here, ``pdd.launch.lab_sites.LabSites``) owns the mechanism: it names the sites, spawns a
child in a site and finds a free port there.
"""

from __future__ import annotations

import random
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from typing import Protocol

from pdd.config import PddConfig
from pdd.errors import ConfigError
from pdd.protocol import Role

AUTO = "auto"
LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::")
DEFAULT_ROUTER_DC = "dc-a"

# (datacenter, host) -> a port that is free there now (the child binds it right away).
PortPicker = Callable[[str, str], int]
# (argv, **popen_kwargs) -> Popen: how a child is started in one site.
Spawn = Callable[..., subprocess.Popen]


@dataclass(frozen=True)
class Site:
    """One datacenter as the launcher places processes in it."""

    dc: str
    netns: str | None  # network namespace its processes run in; None: the launcher's own
    worker_host: str  # what a worker with `host: auto` binds and is dialled at
    router_host: str  # what the router binds when its host is `auto`
    url_host: str  # where this host reaches a service of the site bound to router_host


@dataclass(frozen=True)
class Placed:
    """A topology with every address concrete, and where its router is."""

    cfg: PddConfig
    router_dc: str
    url: str


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_KEYS = ("port", "metrics_port", "kv_port")  # a worker's ports in its config
# the ports resolve_ports picks: the router and workers dial these; a kv_port of 0 stays 0
# (the worker binds any port and reports it to its peers in PrepareKv)
PICKED_PORT_KEYS = ("port", "metrics_port")
PICKED_SPAN = 12_000  # ports below the ephemeral range that free_port picks from
_handed_out: set[int] = set()  # this process's picks (a child may not have bound one yet)


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free on ``host`` a moment ago, for a child that binds it soon.

    Picked below the kernel's ephemeral range, so that no outgoing connection of any process
    takes it as its local port in the meantime (with bind(0) the kernel hands out a port of
    that range, and a gRPC channel opened while a worker's engine loads can hold it for good:
    the child then cannot listen). Never the same port twice in one process. Falls back to
    the kernel's choice when there is no room below the range.
    """
    low = _ephemeral_low()
    first = max(1024, low - PICKED_SPAN)
    rng = random.Random()
    for _ in range(256 if low - first >= 256 else 0):
        port = rng.randrange(first, low)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


class Sites(Protocol):
    """Where the children run; a context manager (enter before use: the lab may come up)."""

    def sites(self) -> dict[str, Site]: ...
    def spawn_for(self, dc: str) -> Spawn: ...
    def pick_port(self, dc: str, host: str) -> int: ...
    def __enter__(self) -> Sites: ...
    def __exit__(self, *exc: object) -> None: ...


class LocalSites:
    """Every datacenter of the config on this host, in the launcher's own namespace."""

    def __init__(self, cfg: PddConfig):
        names = {w.datacenter for w in cfg.workers} | {DEFAULT_ROUTER_DC}
        self._sites = {dc: Site(dc, None, LOOPBACK, LOOPBACK, LOOPBACK) for dc in sorted(names)}

    def sites(self) -> dict[str, Site]:
        return dict(self._sites)

    def spawn_for(self, dc: str) -> Spawn:
        return subprocess.Popen

    def pick_port(self, dc: str, host: str) -> int:
        return free_port(host)

    def __enter__(self) -> LocalSites:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def router_datacenter(cfg: PddConfig) -> str:
    """The router sits next to P: the first prefill worker's datacenter, else dc-a."""
    prefill = [w for w in cfg.workers if w.role is Role.PREFILL]
    return prefill[0].datacenter if prefill else DEFAULT_ROUTER_DC


def place(cfg: PddConfig, sites: Mapping[str, Site], pick: PortPicker | None = None) -> Placed:
    """Fill every `auto` host from its site, then (with ``pick``) every port 0; raise
    ConfigError for an address the router, or this host for the URL, cannot reach."""
    router_dc = router_datacenter(cfg)
    router_site = _site(sites, router_dc, "the router")
    data = cfg.model_dump(mode="json")
    for w, raw in zip(cfg.workers, data["workers"], strict=True):
        site = _site(sites, w.datacenter, f"worker {w.id}")
        if w.host == AUTO:
            raw["host"] = site.worker_host
        elif site.netns != router_site.netns and _local_only(w.host):
            raise ConfigError(
                f"worker {w.id}: host {w.host} in {w.datacenter} cannot be reached from the "
                f"router in {router_dc}; use `host: auto` (its WAN address)"
            )
    if cfg.router.host == AUTO:
        data["router"]["host"] = router_site.router_host
    placed = PddConfig.model_validate(data)
    if pick is not None:
        placed = resolve_ports(placed, pick, router_dc)
    url = router_url(placed.router.host, placed.router.port, router_site)
    return Placed(placed, router_dc, url)


def router_url(host: str, port: int, site: Site) -> str:
    """The URL this host reaches the router at (ConfigError if it cannot)."""
    if host in WILDCARDS or host == site.url_host:
        shown = site.url_host
    elif site.netns is None:
        shown = host
    else:
        raise ConfigError(
            f"router.host {host} in {site.dc} is not reachable from this host; use `auto`, "
            f"0.0.0.0 or the management address {site.url_host}"
        )
    return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/v1"


def resolve_ports(
    cfg: PddConfig, pick: PortPicker | None = None, router_dc: str = DEFAULT_ROUTER_DC
) -> PddConfig:
    """Replace every port 0 by a free port of its site, so the router and workers know each
    other before they start. ``pick`` defaults to a free port of this host.

    A picked port is never one the config names: those are not bound yet either (the test
    harness and operators name some ports and leave others 0), so a free port may be one of
    them, and the child that binds it second could never start (CI: a worker's metrics port
    was another worker's gRPC port; the second failed every restart)."""
    pick = pick or (lambda _dc, host: free_port(host))
    data = cfg.model_dump(mode="json")
    named = {data["router"]["port"]} | {w[k] for w in data["workers"] for k in PORT_KEYS}
    taken = named - {0}

    def fresh(dc: str, host: str) -> int:
        for _ in range(64):
            port = pick(dc, host)
            if port not in taken:
                taken.add(port)
                return port
        raise ConfigError(f"no free port on {host} in {dc} apart from those the config names")

    if data["router"]["port"] == 0:
        data["router"]["port"] = fresh(router_dc, cfg.router.host)
    for w in data["workers"]:
        for key in PICKED_PORT_KEYS:
            if w[key] == 0:
                w[key] = fresh(w["datacenter"], w["host"])
    return PddConfig.model_validate(data)


def _site(sites: Mapping[str, Site], dc: str, who: str) -> Site:
    try:
        return sites[dc]
    except KeyError:
        raise ConfigError(
            f"{who}: unknown datacenter {dc!r} (this placement has {sorted(sites)})"
        ) from None


def _local_only(host: str) -> bool:
    """An address only its own namespace reaches: loopback, or a wildcard (dialled as local)."""
    if host in WILDCARDS or host == "localhost":
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False
