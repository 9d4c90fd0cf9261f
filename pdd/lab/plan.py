"""The lab's names and addresses: a pure function of its LabConfig (no I/O).

Layout for the default subnet 10.77.0.0/28 (offsets are the same for any subnet)::

      host netns                    PREFIX-dc-a                     PREFIX-dc-b
    PREFIX-a  .5/30 ──veth── mgmt0 .6/30                  mgmt0 .10/30 ──veth── .9/30  PREFIX-b
                                   wan0 .1/30 ══ relay ══ wan0 .2/30
                                   (tun, tbf)   delay,    (tun, tbf)
                                                loss

- WAN link (.0/30): one TUN device per datacenter; the relay moves packets between them after
  the one-way delay; each TUN's egress qdisc is a tbf at the link rate with a tail-drop queue.
- Management links (.4/30 and .8/30): unshaped veths between the host and each datacenter, so
  the host reaches services in either datacenter. The datacenters have no default route and
  no route to each other's management address: traffic between them always takes the WAN.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path

from pdd.config.lab import LabConfig

DATACENTERS = ("dc-a", "dc-b")
WAN_IFNAME = "wan0"
MGMT_IFNAME = "mgmt0"
# tbf's bucket holds 1 ms of line rate, so timer slack does not cost rate at high rates.
_BURST_S = 0.001


@dataclass(frozen=True)
class DcPlan:
    """One datacenter: its namespace, its two links and their addresses."""

    name: str  # logical name: dc-a | dc-b
    netns: str  # kernel namespace name: PREFIX-dc-a
    wan_ip: IPv4Address  # on wan0 (TUN), reachable from the other datacenter only
    mgmt_ip: IPv4Address  # on mgmt0 (veth), reachable from the host
    host_ip: IPv4Address  # the host's end of the management link
    host_ifname: str  # the host's end of the management veth


@dataclass(frozen=True)
class LabPlan:
    """Everything `up` makes and `down` removes."""

    cfg: LabConfig
    dcs: tuple[DcPlan, DcPlan]

    @classmethod
    def from_config(cls, cfg: LabConfig) -> LabPlan:
        base = cfg.subnet.network_address
        dcs = tuple(
            DcPlan(
                name=name,
                netns=f"{cfg.prefix}-{name}",
                wan_ip=base + 1 + i,
                mgmt_ip=base + 6 + 4 * i,
                host_ip=base + 5 + 4 * i,
                host_ifname=f"{cfg.prefix}-{name[-1]}",
            )
            for i, name in enumerate(DATACENTERS)
        )
        return cls(cfg=cfg, dcs=dcs)  # type: ignore[arg-type]

    def dc(self, name: str) -> DcPlan:
        for d in self.dcs:
            if d.name == name or d.netns == name:
                return d
        raise KeyError(name)

    @property
    def state_dir(self) -> Path:
        return Path(self.cfg.run_dir) / self.cfg.prefix

    @property
    def log_path(self) -> Path:
        """Kept after `down` so a crash can be read about."""
        return Path(self.cfg.run_dir) / f"{self.cfg.prefix}.log"

    @property
    def rate_bytes_s(self) -> float:
        return self.cfg.rate_mbit * 1e6 / 8

    @property
    def tbf_rate_bytes_s(self) -> float:
        """The kernel's rate limit: rate_mbit, or its highest chaos factor (the relay then
        paces each period's rate itself, see pdd.lab.chaos)."""
        return self.rate_bytes_s * max(self.cfg.rate_factors, default=1.0)

    @property
    def queue_bytes(self) -> int:
        """Tail-drop limit of each direction: configured, else one BDP, at least 16 packets."""
        if self.cfg.queue_bytes is not None:
            return self.cfg.queue_bytes
        bdp = self.rate_bytes_s * 2 * self.cfg.delay_ms / 1000
        return max(int(bdp), 16 * self.cfg.mtu)

    @property
    def burst_bytes(self) -> int:
        """tbf bucket: must hold a whole packet; 1 ms of line rate at high rates."""
        return max(2 * self.cfg.mtu, int(self.rate_bytes_s * _BURST_S))

    @property
    def delay_line_bytes(self) -> int:
        """Memory bound of one relay direction: what the link holds in flight, doubled."""
        in_flight = self.rate_bytes_s * self.cfg.delay_ms / 1000
        return int(2 * in_flight) + 64 * self.cfg.mtu
