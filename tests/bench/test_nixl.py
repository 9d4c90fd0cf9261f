"""The vllm_nixl mode's parts: what its proxy asks P and D, the `vllm serve` command lines and
environments it builds from a pdd topology, what it refuses, and NIXL's progress-thread poll
interval. The mode itself runs for real in tests/bench/test_smoke.py."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path

import httpx
import pytest

from pdd.bench.serve import nixl_progress
from pdd.bench.serve.config import ModeConfig, load_bench_config
from pdd.bench.serve.nixl import Engine, pair_workers, vllm_argv, vllm_env
from pdd.bench.serve.nixl_proxy import build_app, decode_body, prefill_body
from pdd.bench.serve.systems import mode_workers
from pdd.config import load_config
from pdd.errors import ConfigError
from pdd.launch.lab_sites import planned_sites
from tests.helpers import REPO

LAB = Path(REPO) / "configs/lab.yaml"


def test_p_prefills_one_token_and_keeps_the_blocks_and_d_gets_the_client_s_request():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
            "max_completion_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}  # fmt: skip
    p = prefill_body(body)
    assert (p["max_tokens"], p["max_completion_tokens"], p["stream"]) == (1, 1, False)
    assert "stream_options" not in p and p["messages"] == body["messages"]
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    held = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
    d = decode_body(body, held)
    assert d == {**body, "kv_transfer_params": held}
    assert body["max_tokens"] == 64 and "kv_transfer_params" not in body  # not changed


class _Stream(httpx.AsyncByteStream):
    """A response body that arrives as a stream (as D's does), not read in advance."""

    def __init__(self, data: bytes):
        self.data = data

    async def __aiter__(self):
        yield self.data


def _proxy_call(p_status: int, body: dict) -> tuple[httpx.Response, list[tuple[str, dict]]]:
    """One completion through the proxy, P and D faked: (the client's answer, what P and D
    were asked, in order)."""
    asked: list[tuple[str, dict]] = []
    held = {"do_remote_prefill": True, "remote_block_ids": [3], "remote_engine_id": "e"}

    def upstream(req: httpx.Request) -> httpx.Response:
        sent = json.loads(req.content)
        asked.append((req.url.host, sent))
        if req.url.host == "p":
            if p_status != 200:
                err = {"error": {"message": "too long", "param": "prompt", "code": p_status}}
                return httpx.Response(p_status, json=err)
            return httpx.Response(
                200, json={"choices": [{"text": "x"}], "kv_transfer_params": held}
            )
        sse = "".join(f'data: {{"choices": [{{"text": "{t}"}}]}}\n\n' for t in "ab")
        return httpx.Response(200, stream=_Stream((sse + "data: [DONE]\n\n").encode()),
                              headers={"content-type": "text/event-stream"})  # fmt: skip

    app = build_app("http://p", "http://d", transport=httpx.MockTransport(upstream))

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(call()), asked


def test_the_proxy_streams_d_s_answer_to_p_s_blocks_and_passes_p_s_refusal_on():
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True}
    resp, asked = _proxy_call(200, body)
    assert resp.status_code == 200 and resp.text.count("data: ") == 3
    assert [host for host, _ in asked] == ["p", "d"]
    assert asked[0][1]["max_tokens"] == 1 and asked[0][1]["kv_transfer_params"]
    assert asked[1][1]["kv_transfer_params"]["remote_block_ids"] == [3]
    # P refuses (a prompt over its context): the client gets P's answer, D is never asked
    resp, asked = _proxy_call(400, body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert [host for host, _ in asked] == ["p"]


def test_p_and_d_run_the_topology_s_engine_settings_in_its_sites():
    topo = load_config(LAB)
    p_id, d_id = pair_workers(topo)
    assert (p_id, d_id) == ("p", "md")
    sites = planned_sites(topo.lab)
    p = Engine("p", sites["dc-a"], topo.engine_for(p_id), port=8100, side_channel_port=5600)
    d = Engine("d", sites["dc-b"], topo.engine_for(d_id), port=8200, side_channel_port=5601)
    argv = vllm_argv(topo, p, Path("/models/m"))
    flags = {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--dtype"] == "float32" and flags["--block-size"] == "32"
    assert flags["--max-model-len"] == "4096" and flags["--max-num-seqs"] == "16"
    assert flags["--kv-cache-memory-bytes"] == str(1 << 30)
    assert (flags["--host"], flags["--port"]) == (p.host, "8100") and p.host == "10.77.0.1"
    assert json.loads(flags["--kv-transfer-config"])["kv_role"] == "kv_producer"
    assert "--enforce-eager" in argv and "--enable-prompt-tokens-details" in argv
    env = vllm_env(d, in_lab=True, progress_delay_us=100)
    # D's NIXL side channel on its WAN address; UCX over TCP on the lab's WAN device; one
    # engine core in process on D's CPU (as pdd's MD runs)
    assert (env["VLLM_NIXL_SIDE_CHANNEL_HOST"], env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == (
        "10.77.0.2", "5601")  # fmt: skip
    assert (env["UCX_TLS"], env["UCX_NET_DEVICES"]) == ("tcp,self", "wan0")
    assert (env["OMP_PLACES"], env["VLLM_ENABLE_V1_MULTIPROCESSING"]) == ("{1}", "0")
    assert env[nixl_progress.ENV] == "100" and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert vllm_env(d, in_lab=False, progress_delay_us=0)["UCX_NET_DEVICES"] == "lo"


def test_a_topology_without_a_main_decode_or_a_config_is_refused():
    with pytest.raises(ConfigError, match="vllm_nixl needs a prefill worker"):
        pair_workers(load_config(Path(REPO) / "configs/colocated.yaml"))
    with pytest.raises(ConfigError, match="vllm_nixl needs a main_decode worker"):
        pair_workers(load_config(Path(REPO) / "configs/pd_local.yaml"))  # P + RLD
    with pytest.raises(ValueError, match="server vllm_nixl needs a config"):
        ModeConfig(name="x", url="http://x", server="vllm_nixl")
    with pytest.raises(ValueError, match="api_key needs a config"):
        ModeConfig(name="x", config=LAB, server="vllm_nixl", api_key=True)


def test_the_mode_costs_its_p_and_d_only():
    cfg = load_bench_config(Path(REPO) / "configs/bench/wan.yaml")
    nixl = cfg.mode("vllm_nixl")
    assert nixl.server == "vllm_nixl" and nixl.nixl_progress_delay_us == 100
    assert mode_workers(nixl, cfg.cost) == {"gpu_a": 1, "gpu_b": 1}  # the topology's RLD idles
    assert mode_workers(cfg.mode("pdd"), cfg.cost) == {"gpu_a": 2, "gpu_b": 1}


def test_nixl_agents_get_the_poll_interval_and_nothing_else_changes(monkeypatch):
    made = []
    real = types.SimpleNamespace(
        nixlAgent=lambda name, config: made.append((name, config.pthrDelay)) or "agent",
        DEFAULT_COMM_PORT=5555,
    )
    real.__name__ = "nixl_cu12._bindings"
    api = types.SimpleNamespace(nixlBind=real)
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    monkeypatch.setitem(sys.modules, "nixl", types.SimpleNamespace(_api=api))
    monkeypatch.setenv(nixl_progress.ENV, "0")
    nixl_progress.register()
    assert api.nixlBind is real  # 0: NIXL's own busy poll
    monkeypatch.setenv(nixl_progress.ENV, "100")
    nixl_progress.register()
    nixl_progress.register()  # idempotent: wrapped once
    assert api.nixlBind._real is real and api.nixlBind.DEFAULT_COMM_PORT == 5555
    config = types.SimpleNamespace(pthrDelay=0)
    assert api.nixlBind.nixlAgent("a", config) == "agent"
    assert made == [("a", 100)]
