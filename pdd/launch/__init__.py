"""`pdd serve`: the composition root that starts a whole topology as child processes; and
the composition root of one worker process.

placement.py   Site, `auto` hosts -> addresses, free ports, the printed URL (pure);
               LocalSites: every datacenter on this host
lab_sites.py   LabSites: the lab's two datacenters (use the running lab or bring one up)
children.py    each child's command line, and one supervised process (ready line, stop)
topology.py    start workers then the router, wait ready + healthy, stop them all
cli.py         `pdd serve` itself: argument parsing, signals, exit status
worker.py      one worker process (`pdd worker`, `python -m pdd.launch.worker`): picks the
               role, builds the KV plane, engine and gRPC service, serves and drains
"""

from pdd.launch.children import child_env, die_with_parent
from pdd.launch.cli import main
from pdd.launch.placement import free_port, resolve_ports

__all__ = ["child_env", "die_with_parent", "free_port", "main", "resolve_ports"]
