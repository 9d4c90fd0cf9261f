"""Config loading: YAML files, --set overrides, unknown keys rejected with their key path."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from pdd.config import PddConfig, load_config
from pdd.errors import ConfigError
from pdd.protocol import Role, RouterMode

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.workers, f"{path.name} has no workers"


def test_defaults_without_file():
    cfg = load_config(None)
    assert cfg.model.dtype == "float32"  # the same greedy text on every CPU
    assert cfg.router.mode is RouterMode.COLOCATED
    assert cfg.model.resolved_path().name == "SmolLM2-135M-Instruct-float32"


def test_set_overrides_typed_values():
    cfg = load_config(
        "configs/colocated.yaml",
        ["model.dtype=bfloat16", "router.port=0", "router.mode=pdd", "engine.max_num_seqs=4"],
    )
    assert cfg.model.dtype == "bfloat16"
    assert cfg.router.port == 0
    assert cfg.router.mode is RouterMode.PDD
    assert cfg.engine.max_num_seqs == 4
    assert cfg.model.resolved_path().name.endswith("bfloat16")


def test_set_override_list_item():
    cfg = load_config("configs/colocated.yaml", ["workers.0.port=1234"])
    assert cfg.workers[0].port == 1234
    assert cfg.workers[0].role is Role.COLOCATED


def test_unknown_key_names_its_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router:\n  prot: 8000\n")
    with pytest.raises(ConfigError, match=r"router\.prot: unknown key"):
        load_config(bad)


def test_unknown_key_via_set():
    with pytest.raises(ConfigError, match=r"engine\.bogus: unknown key"):
        load_config(None, ["engine.bogus=1"])


def test_bad_value_is_reported():
    with pytest.raises(ConfigError, match=r"model\.dtype"):
        load_config(None, ["model.dtype=int4"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("router: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)


def test_malformed_set():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["router.port"])


def test_duplicate_worker_ids_rejected():
    with pytest.raises(ConfigError, match="duplicate worker ids"):
        load_config(
            None,
            [
                "workers=[{id: a, role: colocated}, {id: a, role: prefill}]",
            ],
        )


def test_config_is_frozen():
    cfg = PddConfig()
    with pytest.raises(ValidationError):
        cfg.router.port = 1  # type: ignore[misc]


def test_an_engine_override_that_workers_with_their_own_engine_never_see_is_named(caplog):
    # configs/lab.yaml gives every worker an engine section of its own (a YAML anchor's copy):
    # `--set engine.X` changes only the top-level default none of them reads, so it says so.
    with caplog.at_level("WARNING", logger="pdd.config"):
        cfg = load_config("configs/lab.yaml", ["engine.max_num_batched_tokens=512"])
    assert cfg.engine_for("p").max_num_batched_tokens is None  # unchanged, as the warning says
    assert "--set engine.max_num_batched_tokens does not reach worker(s) p, rld, md" in caplog.text
    assert "workers.0.engine.max_num_batched_tokens" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pdd.config"):
        load_config("configs/colocated.yaml", ["engine.max_num_seqs=4"])  # reaches every worker
    assert caplog.text == ""
