"""The lab's two datacenters as the sites of `pdd serve` (pdd.lab does the kernel work).

Lifecycle (a context manager)::

    __enter__: the lab of ``lab.prefix`` is up   -> use it as it is; warn about every link
                                                    parameter that differs from the config
               it is down (or broken)            -> bring it up with the config's parameters
    children:  spawned with Lab.spawn_in(dc, ...) (``ip netns exec``: the pid is the child)
    __exit__:  take the lab down only if this launcher brought it up

Ports are picked inside the datacenter's namespace, where the child will bind them. If the
launcher is killed with SIGKILL its children still die (PR_SET_PDEATHSIG), but a lab it
brought up stays: ``pdd lab down`` removes it.
"""

from __future__ import annotations

import errno
import functools
import logging

from pdd.config.lab import LabConfig
from pdd.errors import LabError
from pdd.lab import Lab, LabStatus
from pdd.lab.plan import LabPlan
from pdd.launch.placement import Site, Spawn, free_port

log = logging.getLogger("pdd.launch")

# Link parameters a running lab is compared on (LabStatus field = LabConfig field).
LINK_FIELDS = ("delay_ms", "rate_mbit", "loss", "mtu")


def planned_sites(cfg: LabConfig) -> dict[str, Site]:
    """The sites a lab built from ``cfg`` has (no I/O): to check a topology before any start."""
    return {
        dc.name: _site(dc.name, dc.netns, str(dc.wan_ip), str(dc.mgmt_ip))
        for dc in LabPlan.from_config(cfg).dcs
    }


def status_sites(st: LabStatus) -> dict[str, Site]:
    """The sites of a running lab, from its recorded addresses."""
    return {d.name: _site(d.name, d.netns, d.wan_ip, d.mgmt_ip) for d in st.datacenters}


def _site(name: str, netns: str, wan_ip: str, mgmt_ip: str) -> Site:
    # The router binds 0.0.0.0 inside its namespace: the host reaches it on the management
    # link, the other datacenter on the WAN; nothing else shares the namespace.
    return Site(name, netns, worker_host=wan_ip, router_host="0.0.0.0", url_host=mgmt_ip)


def link_mismatches(st: LabStatus, cfg: LabConfig) -> list[str]:
    """``field=running (config: wanted)`` for every link parameter that differs."""
    wanted = {f: getattr(cfg, f) for f in LINK_FIELDS}
    wanted["queue_bytes"] = LabPlan.from_config(cfg).queue_bytes
    return [
        f"{name}={getattr(st, name)} (config: {value})"
        for name, value in wanted.items()
        if getattr(st, name) != value
    ]


class LabSites:
    """The lab as the place `pdd serve` runs its children in."""

    def __init__(self, cfg: LabConfig):
        self.cfg = cfg
        self.lab = Lab(cfg)
        self.status: LabStatus | None = None
        self.owned = False  # this launcher brought the lab up (and takes it down)

    def __enter__(self) -> LabSites:
        current = self.lab.status()
        if current.state == "up":
            for diff in link_mismatches(current, self.cfg):
                log.warning("lab %s runs with %s; using it as it is", self.cfg.prefix, diff)
            log.info("using the running lab %s", self.cfg.prefix)
            self.status = current
            return self
        log.info(
            "bringing lab %s up: %s ms one way, %s Mbit/s",
            self.cfg.prefix, self.cfg.delay_ms, self.cfg.rate_mbit,
        )  # fmt: skip
        self.owned = True
        try:
            self.status = self.lab.up()
        except LabError:
            self.owned = False  # up() removed what it made
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            log.info("taking lab %s down (this launcher brought it up)", self.cfg.prefix)
            self.lab.down()
            self.owned = False

    def sites(self) -> dict[str, Site]:
        if self.status is None:
            raise LabError("the lab is not open")
        return status_sites(self.status)

    def spawn_for(self, dc: str) -> Spawn:
        return functools.partial(self.lab.spawn_in, dc)

    def pick_port(self, dc: str, host: str) -> int:
        """A free port on ``host`` inside ``dc`` (this thread enters the namespace briefly).

        LabError if ``host`` is not there: the lab went away while this launcher set up (e.g.
        another `pdd serve` that had brought it up was stopping)."""
        try:
            with self.lab.enter(dc):
                return free_port(host)
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            raise LabError(
                f"lab {self.cfg.prefix}: cannot bind {host} in {dc} ({exc.strerror}); the lab "
                "went away while this `pdd serve` started (was another one stopping?): run "
                f"it again, or check `pdd lab status --prefix {self.cfg.prefix}`"
            ) from exc
