"""KV arenas sized against max_model_len (pdd.worker.capacity; issue 16, Build item 7): a
worker whose arena cannot hold one request at max_model_len refuses to start, naming the
setting and the size it needs; one that cannot hold max_num_seqs of them starts with a
warning. The roles describe their arenas in ``plane_spec``."""

from __future__ import annotations

import asyncio

import pytest

from pdd.config import PddConfig, load_config
from pdd.config.cache import GIB
from pdd.errors import ConfigError
from pdd.launch.worker import _build
from pdd.main_decode.policy import MainDecodeRole
from pdd.prefill.policy import PrefillRole
from pdd.relay_decode.policy import RelayDecodeRole
from pdd.worker.capacity import ArenaSize, blocks_per_request, check_arenas, gib_for

BLOCK_BYTES = 46_080 * 32  # SmolLM2-135M, float32, 32-token blocks: 1,474,560 B


def config(staging_gib: float = 0.5, drc_gib: float = 2.0, store: bool = True) -> PddConfig:
    w = {"kv_staging_gib": staging_gib}
    return PddConfig.model_validate({
        "engine": {"max_model_len": 4096, "block_size": 32, "max_num_seqs": 4},
        "cache": {"host_capacity_gib": drc_gib},
        "workers": [
            {"id": "p", "role": "prefill", **w},
            {"id": "rld", "role": "relay_decode", **w},
            {"id": "md", "role": "main_decode", "datacenter": "dc-b",
             "kv_store_own_blocks": store, **w},
        ],
    })  # fmt: skip


def check(cfg: PddConfig, index: int, role) -> list[str]:  # type: ignore[no-untyped-def]
    spec = role.plane_spec(cfg.workers[index], BLOCK_BYTES, cfg)
    e = cfg.engine
    return check_arenas(
        spec.arenas, max_model_len=e.max_model_len, max_num_seqs=e.max_num_seqs,
        block_size=e.block_size, block_bytes=BLOCK_BYTES,
    )  # fmt: skip


ROLES = [(0, PrefillRole, "KV staging arena"), (1, RelayDecodeRole, "KV landing arena")]


def test_sizes():
    assert blocks_per_request(4096, 32) == 128 and blocks_per_request(4097, 32) == 129
    assert gib_for(128, BLOCK_BYTES) == 0.176  # 188,743,680 B = 0.1758 GiB, rounded up


@pytest.mark.parametrize(("index", "role", "what"), ROLES)
def test_a_staging_arena_too_small_for_one_request_refuses_to_start(index, role, what):
    cfg = config(staging_gib=0.1)  # 72 blocks; a 4,096-token request needs 128
    with pytest.raises(ConfigError) as err:
        check(cfg, index, role)
    assert err.value.message == (
        f"KV arena too small for max_model_len: the {what} (workers.{index}.kv_staging_gib=0.1) "
        f"holds 72 KV blocks of {BLOCK_BYTES} B; one request at max_model_len 4096 needs 128 "
        f"(block_size 32): set workers.{index}.kv_staging_gib >= 0.176"
    )


@pytest.mark.parametrize(("index", "role", "what"), ROLES)
def test_an_arena_for_one_request_but_not_max_num_seqs_warns(index, role, what):
    (warning,) = check(config(staging_gib=0.5), index, role)  # 364 blocks < 4 x 128
    assert warning.startswith(f"the {what} (workers.{index}.kv_staging_gib=0.5) holds 364")
    assert "max_num_seqs 4" in warning and f"workers.{index}.kv_staging_gib >= 0.704" in warning
    assert check(config(staging_gib=0.704), index, role) == []


def test_main_decode_checks_its_drc_only():
    """MD's one arena is its DRC: its own blocks are exported straight into DRC landing
    slots, so kv_staging_gib sizes nothing on MD, whether it stores them or not."""
    assert check(config(staging_gib=0.5, drc_gib=2.0), 2, MainDecodeRole) == []
    with pytest.raises(ConfigError, match=r"DRC host tier \(cache.host_capacity_gib=0.1\)"):
        check(config(drc_gib=0.1), 2, MainDecodeRole)
    for store in (True, False):
        assert check(config(staging_gib=0.1, store=store), 2, MainDecodeRole) == []
    (warning,) = check(config(drc_gib=0.5), 2, MainDecodeRole)
    assert warning.startswith("the DRC host tier (cache.host_capacity_gib=0.5) holds 364")


def test_every_short_arena_is_named():
    arenas = (
        ArenaSize("a", "x.a", 0.001, 1),
        ArenaSize("b", "x.b", 1.0, 1000),
        ArenaSize("c", "x.c", 0.002, 2, per_sequence=False),
    )
    with pytest.raises(ConfigError) as err:
        check_arenas(arenas, max_model_len=64, max_num_seqs=1, block_size=16,
                     block_bytes=GIB // 1000)  # fmt: skip
    assert "x.a" in err.value.message and "x.c" in err.value.message
    assert "x.b" not in err.value.message


def test_the_worker_refuses_before_any_arena_or_engine_exists():
    """The composition root checks the arenas first: nothing is made (no shared memory, no
    engine), and `pdd prefill` exits 1 with this message (pdd.launch.worker._run)."""
    cfg = load_config("configs/local.yaml", ["workers.0.kv_staging_gib=0.1"])
    parts: dict = {}
    with pytest.raises(ConfigError, match=r"workers\.0\.kv_staging_gib >= 0\.176"):
        asyncio.run(_build(cfg, cfg.workers[0], parts))
    assert parts == {}
