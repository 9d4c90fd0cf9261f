"""The shipped topologies: each loads, places on this host (and lab*.yaml in the lab), and the
router's own policy picks the workers each one is meant to exercise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdd.cache.host_tier import kv_block_bytes
from pdd.config import LabConfig, PddConfig, load_config
from pdd.launch.cli import DEFAULT_CONFIG, wants_lab
from pdd.launch.lab_sites import planned_sites
from pdd.launch.placement import LocalSites, place
from pdd.protocol import Pipeline, Role, RouterMode
from pdd.router.decide.routing import choose
from pdd.router.decide.view import FleetView, RouteRequest, WorkerView

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = sorted(REPO.joinpath("configs").glob("*.yaml"))  # configs/bench/ holds no topology


def route(cfg: PddConfig, prompt_tokens: int = 1000) -> dict[Role, str]:
    """The router policy's choice for one request, every worker healthy and idle."""
    view = FleetView(
        cfg.router.mode,
        tuple(WorkerView(w.id, w.role, True, datacenter=w.datacenter) for w in cfg.workers),
        cfg.router.pdd,
    )
    decision = choose(view, RouteRequest(prompt_tokens=prompt_tokens, max_tokens=16))
    return dict(decision.assignments)


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_every_shipped_topology_places_on_this_host(path):
    cfg = load_config(path)
    placed = place(cfg, LocalSites(cfg).sites())
    assert placed.url == f"http://127.0.0.1:{cfg.router.port}/v1"
    assert all(w.host == "127.0.0.1" for w in placed.cfg.workers)
    assert wants_lab(str(path), []) == (path.name in ("lab.yaml", "lab-hetero.yaml"))


def test_local_is_the_default_pdd_topology():
    assert DEFAULT_CONFIG == "configs/local.yaml"
    assert re.search(r"^CONFIG \?= configs/local\.yaml$", (REPO / "Makefile").read_text(), re.M)
    cfg = load_config(REPO / DEFAULT_CONFIG)
    assert cfg.router.mode is RouterMode.PDD
    assert [(w.id, w.role, w.datacenter) for w in cfg.workers] == [
        ("p", Role.PREFILL, "dc-a"),
        ("rld", Role.RELAY_DECODE, "dc-a"),
        ("md", Role.MAIN_DECODE, "dc-b"),
    ]
    engines = [cfg.engine_for(w.id) for w in cfg.workers]
    assert [(e.kv_cache_space_gib, e.block_size) for e in engines] == [(1, 32)] * 3
    assert [e.omp_threads_bind for e in engines] == ["0", "1", "1"]  # P | RLD + MD
    assert route(cfg) == {Role.PREFILL: "p", Role.RELAY_DECODE: "rld", Role.MAIN_DECODE: "md"}


@pytest.mark.parametrize(
    ("name", "mode", "decoder"),
    [("pd_wan.yaml", RouterMode.PD_WAN, "d"), ("pd_local.yaml", RouterMode.PD_LOCAL, "d")],
)
def test_baselines_route_to_their_one_decoder(name, mode, decoder):
    cfg = load_config(REPO / "configs" / name)
    assert cfg.router.mode is mode
    assert len(cfg.workers) == 2
    chosen = route(cfg)
    assert chosen[Role.PREFILL] == "p"
    assert decoder in chosen.values()
    p, d = cfg.worker("p"), cfg.worker(decoder)
    assert (p.datacenter != d.datacenter) == (mode is RouterMode.PD_WAN)
    assert [cfg.engine_for(w).omp_threads_bind for w in ("p", decoder)] == ["0", "1"]


@pytest.mark.parametrize(
    ("mode", "decoder"), [("pd_wan", ("md", "dc-b")), ("pd_local", ("rld", "dc-a"))]
)
def test_lab_topology_runs_the_baselines_too(mode, decoder):
    cfg = load_config(REPO / "configs/lab.yaml", [f"router.mode={mode}"])
    chosen = route(cfg)
    d = next(wid for role, wid in chosen.items() if role is not Role.PREFILL)
    assert (d, cfg.worker(d).datacenter) == decoder


def test_lab_topology_places_router_and_p_in_dc_a_and_md_in_dc_b():
    cfg = load_config(REPO / "configs/lab.yaml")
    assert (cfg.lab.delay_ms, cfg.lab.rate_mbit) == (10, 100)
    placed = place(cfg, planned_sites(LabConfig()))
    assert placed.router_dc == "dc-a"
    assert {w.id: (w.datacenter, w.host) for w in placed.cfg.workers} == {
        "p": ("dc-a", "10.77.0.1"),
        "rld": ("dc-a", "10.77.0.1"),
        "md": ("dc-b", "10.77.0.2"),
    }
    assert placed.url == "http://10.77.0.6:8000/v1"
    # A cold 1,000-token prompt exceeds the TTFT budget on this link: the relay is used.
    decision_roles = route(cfg)
    assert Role.RELAY_DECODE in decision_roles


def test_pdd_pipeline_choice_on_the_lab_link():
    """With P's block geometry known, a warm prompt goes p_md, a cold one p_rld_md."""
    cfg = load_config(REPO / "configs/lab.yaml")
    itemsize = {"float32": 4, "bfloat16": 2}[cfg.model.dtype]
    geometry = dict(block_size=32, kv_block_bytes=kv_block_bytes(30, 3, 64, 32, itemsize))
    view = FleetView(
        RouterMode.PDD,
        tuple(
            WorkerView(w.id, w.role, True, datacenter=w.datacenter, **geometry) for w in cfg.workers
        ),
        cfg.router.pdd,
    )
    cold = choose(view, RouteRequest(prompt_tokens=1024, max_tokens=16))
    warm = choose(view, RouteRequest(1024, 16, md_cached_tokens={"md": 992}))
    assert (cold.pipeline, warm.pipeline) == (Pipeline.P_RLD_MD, Pipeline.P_MD)


@pytest.mark.parametrize(
    ("overrides", "placement", "expected"),
    [
        ([], "auto", False),
        (["lab.delay_ms=5"], "auto", True),
        ([], "lab", True),
        (["lab.delay_ms=5"], "local", False),
    ],
)
def test_placement_choice(overrides, placement, expected):
    assert wants_lab(str(REPO / "configs/local.yaml"), overrides, placement) is expected
