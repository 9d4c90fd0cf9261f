"""The benchmark's config and command line: profiles, overrides, modes, and clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdd.bench.serve import main
from pdd.bench.serve.cli import parse_args, resolve_config
from pdd.bench.serve.config import SHORT_PROFILE, ModeConfig, load_bench_config
from pdd.bench.serve.systems import ServedTopology, mode_workers, ready_url
from pdd.errors import ConfigError
from tests.helpers import REPO

EXAMPLE = Path(REPO) / "configs/bench/agentic.yaml"


def _cfg(*argv):
    return resolve_config(parse_args(list(argv)))


def test_example_config_loads_and_fits_its_context():
    cfg = load_bench_config(EXAMPLE)
    assert cfg.workloads == ["agentic", "sweep"]
    assert [m.name for m in cfg.modes] == ["colocated"]
    assert "engine.max_model_len=8192" in cfg.modes[0].overrides
    assert cfg.agentic.prompt_tokens_max + cfg.agentic.output_tokens_max <= 8192
    assert cfg.sweep.prompt_tokens + cfg.sweep.output_tokens <= 8192


@pytest.mark.parametrize("path", sorted(Path(REPO).joinpath("configs/bench").glob("*.yaml")),
                         ids=lambda p: p.name)  # fmt: skip
def test_every_shipped_bench_config_loads_and_its_topologies_exist(path):
    cfg = load_bench_config(path)
    for m in cfg.modes:
        assert m.config is None or Path(REPO, m.config).is_file(), (m.name, m.config)
    assert cfg.modes


def test_short_profile_then_user_overrides():
    cfg = _cfg("--short", "--set", "agentic.requests=5", "--set", "sla.ttft_s=0.5")
    assert (cfg.agentic.requests, cfg.agentic.conversations) == (5, 3)
    assert cfg.sweep.buckets == [0.0, 0.9, 1.0]
    assert cfg.sla.ttft_s == 0.5
    assert "agentic.requests=12" in SHORT_PROFILE


def test_mode_endpoints_and_selection():
    cfg = _cfg("--mode", "colocated=http://127.0.0.1:1/v1", "--mode", "pdd=http://127.0.0.1:2")
    assert [(m.name, m.url, m.config) for m in cfg.modes] == [
        ("colocated", "http://127.0.0.1:1/v1", None),
        ("pdd", "http://127.0.0.1:2", None),
    ]
    cfg = _cfg("--mode", "pdd=http://x", "--modes", "pdd", "--workloads", "sweep")
    assert [m.name for m in cfg.modes] == ["pdd"] and cfg.workloads == ["sweep"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "agentic.nope=1"], "agentic.nope: unknown key"),
        (["--set", "agentic.prompt_tokens_min=9000"], "prompt_tokens_min is above"),
        (["--set", "sweep.buckets=[0.5,1.5]"], "buckets must lie in [0, 1]"),
        (["--workloads", "trace"], "workload trace needs trace.path"),
        (["--modes", "pdd"], "--modes: unknown mode(s) ['pdd']"),
        (["--mode", "colocated"], "--mode expects NAME=URL"),
        (["--config", "nope.yaml"], "benchmark config not found: nope.yaml"),
    ],
)
def test_bad_arguments_are_explained(argv, message):
    with pytest.raises(ConfigError) as info:
        _cfg(*argv)
    assert message in info.value.message


def test_main_exits_2_on_a_bad_trace_before_starting_anything(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "max_tokens": 4}\n')
    argv = ["--workloads", "trace", "--set", f"trace.path={trace}", "--out", str(tmp_path / "o")]
    argv += ["--set", "tokenizer=estimate"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{trace}:1: give exactly one of messages and prompt" in err
    assert not (tmp_path / "o").exists()


def test_workers_and_cost_of_a_mode():
    cfg = load_bench_config()
    colocated = ModeConfig(name="colocated", config=Path(REPO) / "configs/colocated.yaml")
    assert mode_workers(colocated, cfg.cost) == {"gpu_a": 1}
    explicit = ModeConfig(name="pdd", url="http://x", workers={"gpu_a": 2, "gpu_b": 1})
    assert mode_workers(explicit, cfg.cost) == {"gpu_a": 2, "gpu_b": 1}
    assert mode_workers(ModeConfig(name="x", url="http://x"), cfg.cost) == {}


def test_served_topology_command_line(tmp_path):
    mode = ModeConfig(name="colocated", config=Path("configs/colocated.yaml"), overrides=["a.b=1"])
    topo = ServedTopology(mode, 10, tmp_path / "serve.log")
    assert topo.argv()[1:] == [
        "-m", "pdd.cli", "serve", "--config", "configs/colocated.yaml",
        "--set", "router.port=0", "--set", "a.b=1",
    ]  # fmt: skip
    topo.stop()  # never started: nothing to do


def test_an_api_key_mode_serves_with_a_fresh_private_keys_file(tmp_path):
    mode = ModeConfig(name="on", config=Path("configs/lab.yaml"), api_key=True)
    topo = ServedTopology(mode, 10, tmp_path / "serve-on.log")
    keys = tmp_path / "keys-on.txt"
    assert f"router.api_keys_file={keys}" in topo.argv()
    topo._write_key()
    assert keys.stat().st_mode & 0o777 == 0o600
    assert keys.read_text().split()[0] == topo.api_key and len(topo.api_key) >= 32
    with pytest.raises(ValueError, match="api_key needs a config"):
        ModeConfig(name="x", url="http://x", api_key=True)


def test_ready_line_is_found_even_when_a_child_line_runs_into_it():
    assert ready_url("pdd ready: http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    line = "[w0] pdd worker ready: id=w0 metrics=127.0.0.1:51071pdd ready: http://h:1/v1"
    assert ready_url(line) == "http://h:1/v1"
    assert ready_url("[router] pdd router ready: http://h:1/v1") is None


def test_the_benchmark_never_loads_torch_or_vllm():
    code = "import sys, pdd.bench.serve.run; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False"], out.stderr
