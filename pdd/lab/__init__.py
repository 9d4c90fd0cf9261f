"""Two datacenters on one machine: network namespaces joined by a shaped WAN link.

Owns the test bed only (no serving code imports it except the composition root)::

    plan.py        names and addresses, a pure function of LabConfig
    netns.py       kernel mechanism: ip/tc, setns, TUN devices, process liveness
    topology.py    build / teardown of namespaces, links, qdiscs
    relay.py       the relay process: delay and loss on the WAN
    supervisor.py  the daemon that owns a running lab and removes it when the relay ends
    state.py       the files a running lab records, and LabStatus
    measure.py     RTT and throughput of the link
    lab.py         the API: Lab(cfg).up() / down() / status() / spawn_in() / exec() / enter()
    cli.py         `pdd lab up | down | status | exec`
"""

from pdd.lab.lab import Lab
from pdd.lab.measure import LinkMeasurement
from pdd.lab.state import DcStatus, LabStatus

__all__ = ["DcStatus", "Lab", "LabStatus", "LinkMeasurement"]
