"""Which deferred transfers to an MD a new request supersedes (pdd.router.fleet.deferred)."""

from __future__ import annotations

from pdd.config import ModelConfig
from pdd.router.fleet.deferred import DeferredKv

BS = 4
HISTORY = list(range(40))  # 10 whole blocks


def _kv(capacity: int = 64) -> DeferredKv:
    return DeferredKv(ModelConfig(), ttl_s=120.0, capacity=capacity)


def test_the_next_turn_supersedes_the_transfer_of_the_history_it_extends() -> None:
    kv = _kv()
    kv.add("md", "turn1", "p", HISTORY + [1, 2], BS, "", now=0.0)  # the tail block is no part
    assert kv.superseded_by("md-other", HISTORY + [7] * 8, BS, "", now=1.0) == []
    [old] = kv.superseded_by("md", HISTORY + [7] * 8, BS, "", now=1.0)
    assert (old.kv_id, old.p, old.blocks) == ("turn1", "p", 10)
    assert kv.superseded_by("md", HISTORY + [7] * 8, BS, "", now=1.0) == []  # forgotten


def test_a_prompt_that_does_not_extend_it_leaves_it_crossing() -> None:
    kv = _kv()
    kv.add("md", "turn1", "p", HISTORY, BS, "", now=0.0)
    shared_system_prompt = HISTORY[:20] + [9] * 40  # the first 5 blocks only
    assert kv.superseded_by("md", shared_system_prompt, BS, "", now=1.0) == []
    assert kv.superseded_by("md", HISTORY[:36], BS, "", now=1.0) == []  # shorter
    assert kv.superseded_by("md", HISTORY, BS, "tenant-b", now=1.0) == []  # another tenant
    assert [d.kv_id for d in kv.superseded_by("md", HISTORY, BS, "", now=1.0)] == ["turn1"]


def test_entries_end_with_the_send_deadline_and_the_oldest_go_first() -> None:
    kv = _kv(capacity=2)
    kv.add("md", "expired", "p", HISTORY, BS, "", now=0.0)
    assert kv.superseded_by("md", HISTORY, BS, "", now=121.0) == []
    for i, kv_id in enumerate(("a", "b", "c")):
        kv.add("md", kv_id, "p", HISTORY, BS, "", now=200.0 + i)
    assert [d.kv_id for d in kv.superseded_by("md", HISTORY, BS, "", now=210.0)] == ["b", "c"]
    kv.add("md", "short", "p", [1, 2], BS, "", now=0.0)  # no whole block: nothing to track
    assert kv.superseded_by("md", [1, 2, 3, 4], BS, "", now=1.0) == []
