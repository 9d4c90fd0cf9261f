"""Make and remove the lab's namespaces, links, addresses and qdiscs (see pdd.lab.plan).

Lifecycle: ``build`` makes the namespaces and management links; ``open_wan`` creates the two
TUN devices of the WAN link, configures them and returns their fds (the devices vanish when
the relay that holds the fds exits); ``teardown`` removes everything and is idempotent, so
it doubles as the cleanup of leftovers from a lab whose supervisor and relay both died.
"""

from __future__ import annotations

import logging
import os
from ipaddress import IPv4Interface

from pdd.errors import LabError
from pdd.lab import netns
from pdd.lab.plan import MGMT_IFNAME, WAN_IFNAME, DcPlan, LabPlan

log = logging.getLogger(__name__)

# Per-namespace sysctls: no IPv6 (no stray router solicitations on the WAN), TCP buffers
# big enough for the bandwidth-delay product of a fast long link (1 Gbit/s x 50 ms = 6 MB), and
# a connection that sat idle keeps its congestion window (Linux's default drops it to 10
# segments after an idle RTO: a warmed-up KV link would ramp up again at its first transfer).
# What a datacenter host serving a WAN link is tuned to (docs/operations.md).
_SYSCTLS = {
    "net.ipv4.tcp_slow_start_after_idle": "0",
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
    "net.ipv4.tcp_rmem": "4096 131072 33554432",
    "net.ipv4.tcp_wmem": "4096 16384 33554432",
}
_GONE = ("Cannot find device", "No such file", "does not exist", "Cannot open network namespace")


def check_free(plan: LabPlan) -> None:
    """Raise LabError if a host interface already holds an address of the lab's subnet."""
    out = netns.run(["ip", "-4", "-o", "addr", "show"])
    for line in out.splitlines():
        fields = line.split()
        ifname, cidr = fields[1], fields[3]
        if plan.cfg.subnet.overlaps(IPv4Interface(cidr).network):
            raise LabError(
                f"subnet {plan.cfg.subnet} is in use: {ifname} has {cidr} "
                "(give this lab another lab.subnet)"
            )


def build(plan: LabPlan) -> None:
    """Make both namespaces and their management links. Raises LabError (caller tears down)."""
    for dc in plan.dcs:
        netns.run(["ip", "netns", "add", dc.netns])
        _ns_ip(dc, "link", "set", "lo", "up")
        for key, value in _SYSCTLS.items():
            path = "/proc/sys/" + key.replace(".", "/")
            with netns.enter(dc.netns):
                _write_sysctl(path, value)
        _make_mgmt_link(dc)


def _write_sysctl(path: str, value: str) -> None:
    # /proc/sys/net follows the writer's network namespace (the thread's, after setns).
    with open(path, "w") as f:
        f.write(value)


def _make_mgmt_link(dc: DcPlan) -> None:
    netns.run(
        ["ip", "link", "add", dc.host_ifname, "type", "veth"]
        + ["peer", "name", MGMT_IFNAME, "netns", dc.netns]
    )
    netns.run(["ip", "addr", "add", f"{dc.host_ip}/30", "dev", dc.host_ifname])
    netns.run(["ip", "link", "set", dc.host_ifname, "up"])
    _ns_ip(dc, "addr", "add", f"{dc.mgmt_ip}/30", "dev", MGMT_IFNAME)
    _ns_ip(dc, "link", "set", MGMT_IFNAME, "up")


def open_wan(plan: LabPlan) -> dict[str, int]:
    """Create and configure the WAN TUN device in each datacenter; return {dc name: fd}.

    The caller owns the fds. Rate and queue are the kernel's: a tbf qdisc on each TUN's
    egress (the sending side of each direction), so the relay only adds delay and loss.
    """
    fds: dict[str, int] = {}
    try:
        for dc in plan.dcs:
            fds[dc.name] = netns.open_tun(dc.netns, WAN_IFNAME)
            _configure_wan(plan, dc)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def _configure_wan(plan: LabPlan, dc: DcPlan) -> None:
    cfg = plan.cfg
    _ns_ip(dc, "link", "set", WAN_IFNAME, "mtu", str(cfg.mtu), "txqueuelen", "1000")
    _ns_ip(dc, "addr", "add", f"{dc.wan_ip}/30", "dev", WAN_IFNAME)
    _ns_ip(dc, "link", "set", WAN_IFNAME, "up")
    shape_wan(plan, dc)


def shape_wan(plan: LabPlan, dc: DcPlan) -> None:
    """The rate and queue of ``dc``'s WAN egress: a tbf qdisc (replaced in place)."""
    tbf = ["tbf", "rate", f"{int(plan.tbf_rate_bytes_s * 8)}bit"]
    tbf += ["burst", str(plan.burst_bytes), "limit", str(plan.queue_bytes)]
    netns.run(["tc", "-n", dc.netns, "qdisc", "replace", "dev", WAN_IFNAME, "root", *tbf])


def teardown(plan: LabPlan) -> None:
    """Remove everything the lab made. Idempotent; safe on a half-built or crashed lab.

    Processes still running inside the lab namespaces are stopped first (SIGTERM, then
    SIGKILL after 5 s): a process left inside would keep a deleted namespace alive.
    """
    pids = [pid for dc in plan.dcs for pid in netns.netns_pids(dc.netns)]
    if pids:
        log.info("stopping %d process(es) inside the lab: %s", len(pids), pids)
        netns.stop_pids(pids)
    for dc in plan.dcs:
        if netns.netns_exists(dc.netns):
            netns.run(["ip", "netns", "del", dc.netns], ok_errors=_GONE)
        if netns.link_exists(dc.host_ifname):
            netns.run(["ip", "link", "del", dc.host_ifname], ok_errors=_GONE)


def leftovers(plan: LabPlan) -> list[str]:
    """Names of what the lab makes that exist now (empty after a clean teardown)."""
    found = [dc.netns for dc in plan.dcs if netns.netns_exists(dc.netns)]
    found += [dc.host_ifname for dc in plan.dcs if netns.link_exists(dc.host_ifname)]
    return found


def _ns_ip(dc: DcPlan, *args: str) -> None:
    netns.run(["ip", "-n", dc.netns, *args])
