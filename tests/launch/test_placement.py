"""Addresses and ports of a placed topology: `auto` hosts, reachability checks, the URL."""

from __future__ import annotations

import itertools
import socket

import pytest

from pdd.config import LabConfig, load_config
from pdd.errors import ConfigError
from pdd.launch import placement
from pdd.launch.lab_sites import planned_sites
from pdd.launch.placement import LocalSites, place, resolve_ports, router_datacenter

LAB = LabConfig(prefix="pdtunit", subnet="10.77.2.0/24")


def lab_cfg(*overrides: str):
    return load_config("configs/lab.yaml", list(overrides))


def test_lab_auto_hosts_become_wan_addresses_and_url_the_management_one():
    placed = place(lab_cfg(), planned_sites(LAB))
    hosts = {w.id: w.host for w in placed.cfg.workers}
    assert hosts == {"p": "10.77.2.1", "rld": "10.77.2.1", "md": "10.77.2.2"}
    assert placed.cfg.router.host == "0.0.0.0"
    assert placed.router_dc == "dc-a"
    assert placed.url == "http://10.77.2.6:8000/v1"


def test_default_subnet_matches_the_documented_addresses():
    placed = place(lab_cfg(), planned_sites(LabConfig()))
    assert [w.host for w in placed.cfg.workers] == ["10.77.0.1", "10.77.0.1", "10.77.0.2"]
    assert placed.url == "http://10.77.0.6:8000/v1"


def test_auto_is_loopback_on_this_host():
    cfg = lab_cfg()
    placed = place(cfg, LocalSites(cfg).sites())
    assert {w.host for w in placed.cfg.workers} == {"127.0.0.1"}
    assert placed.cfg.router.host == "127.0.0.1"
    assert placed.url == "http://127.0.0.1:8000/v1"


def test_loopback_worker_in_the_other_datacenter_is_refused_in_the_lab():
    with pytest.raises(
        ConfigError, match=r"worker md: host 127\.0\.0\.1 in dc-b cannot be reached"
    ):
        place(load_config("configs/local.yaml"), planned_sites(LAB))


def test_loopback_worker_next_to_the_router_is_accepted_in_the_lab():
    placed = place(lab_cfg("workers.0.host=127.0.0.1"), planned_sites(LAB))
    assert placed.cfg.workers[0].host == "127.0.0.1"


def test_explicit_wan_address_is_kept():
    placed = place(lab_cfg("workers.2.host=10.77.2.2"), planned_sites(LAB))
    assert placed.cfg.workers[2].host == "10.77.2.2"


def test_unknown_datacenter_is_refused_in_the_lab():
    with pytest.raises(ConfigError, match=r"worker md: unknown datacenter 'dc-c'"):
        place(lab_cfg("workers.2.datacenter=dc-c"), planned_sites(LAB))


@pytest.mark.parametrize(
    ("host", "url"),
    [("0.0.0.0", "http://10.77.2.6:8000/v1"), ("10.77.2.6", "http://10.77.2.6:8000/v1")],
)
def test_router_host_reachable_from_this_host(host, url):
    assert place(lab_cfg(f"router.host={host}"), planned_sites(LAB)).url == url


@pytest.mark.parametrize("host", ["10.77.2.1", "127.0.0.1"])
def test_router_host_unreachable_from_this_host_is_refused(host):
    with pytest.raises(ConfigError, match=rf"router.host {host} in dc-a is not reachable"):
        place(lab_cfg(f"router.host={host}"), planned_sites(LAB))


def test_router_runs_next_to_the_first_prefill_worker():
    assert router_datacenter(lab_cfg()) == "dc-a"
    assert router_datacenter(lab_cfg("workers.0.datacenter=dc-b")) == "dc-b"
    colocated = load_config("configs/colocated.yaml", ["workers.0.datacenter=dc-b"])
    assert router_datacenter(colocated) == "dc-a"


def test_router_next_to_p_in_dc_b_gets_dc_b_addresses():
    placed = place(lab_cfg("workers.0.datacenter=dc-b"), planned_sites(LAB))
    assert placed.router_dc == "dc-b"
    assert placed.url == "http://10.77.2.10:8000/v1"
    assert placed.cfg.workers[0].host == "10.77.2.2"


def test_ports_zero_are_picked_in_the_site_of_their_process():
    calls: list[tuple[str, str]] = []
    numbers = itertools.count(20001)

    def pick(dc: str, host: str) -> int:
        calls.append((dc, host))
        return next(numbers)

    cfg = lab_cfg("router.port=0", "workers.1.port=9999")
    placed = place(cfg, planned_sites(LAB), pick)
    assert calls == [
        ("dc-a", "0.0.0.0"),  # router
        ("dc-a", "10.77.2.1"),  # p port
        ("dc-a", "10.77.2.1"),  # p metrics_port
        ("dc-a", "10.77.2.1"),  # rld metrics_port (its port is explicit)
        ("dc-b", "10.77.2.2"),  # md port
        ("dc-b", "10.77.2.2"),  # md metrics_port
    ]
    ports = [(w.port, w.metrics_port) for w in placed.cfg.workers]
    assert ports == [(20002, 20003), (9999, 20004), (20005, 20006)]
    assert placed.url == "http://10.77.2.6:20001/v1"


def test_a_picked_port_is_never_one_the_config_names():
    """The harness names each worker's port and leaves its metrics port 0; `pdd serve` picks
    that one while no worker listens yet. A pick equal to another worker's named port would
    leave that worker unable to start however often it restarted."""
    cfg = load_config("configs/local.yaml", ["workers.0.port=21000", "workers.1.port=21001",
                                             "workers.2.port=21002"])  # fmt: skip
    offers = iter([21001, 21002, 21000, 21003, 21004, 21005])  # free now: nothing bound yet
    placed = resolve_ports(cfg, lambda _dc, _host: next(offers))
    ports = [(w.port, w.metrics_port) for w in placed.workers]
    assert ports == [(21000, 21003), (21001, 21004), (21002, 21005)]


def test_resolve_ports_on_this_host_gives_distinct_bindable_ports():
    cfg = resolve_ports(load_config("configs/local.yaml", ["router.port=0"]))
    ports = [cfg.router.port] + [p for w in cfg.workers for p in (w.port, w.metrics_port)]
    assert all(p > 0 for p in ports)
    assert len(set(ports)) == len(ports)


def test_free_ports_are_below_the_ephemeral_range_and_never_repeat():
    """A picked port cannot be taken as the local port of an outgoing connection while the
    child that is to listen on it starts (CI: a router found its port held that way)."""
    low = placement._ephemeral_low()
    ports = [placement.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if low - 1024 >= 256:  # room below the range (Linux's default: 32768)
        assert all(max(1024, low - placement.PICKED_SPAN) <= p < low for p in ports)
    with socket.socket() as s:  # and each is free to bind
        s.bind((placement.LOOPBACK, ports[-1]))


def test_a_lab_gone_while_serve_starts_is_a_clear_lab_error(monkeypatch):
    # `pdd serve` found the lab up, then it went away (another serve that brought it up was
    # stopping): picking a port on an address no longer there names the lab, not a traceback.
    import contextlib

    from pdd.errors import LabError
    from pdd.launch.lab_sites import LabSites

    sites = LabSites(LAB)
    monkeypatch.setattr(sites.lab, "enter", lambda dc: contextlib.nullcontext())
    with pytest.raises(LabError, match="lab pdtunit: cannot bind 192.0.2.1 in dc-a"):
        sites.pick_port("dc-a", "192.0.2.1")  # TEST-NET: never this host's address
