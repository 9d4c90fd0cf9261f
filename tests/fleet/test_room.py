"""The router's view of each worker's KV room between two Stats polls (no sockets)."""

from __future__ import annotations

from pdd.config import PddConfig
from pdd.proto import worker_pb2
from pdd.protocol import HandoffMode, Pipeline, Role
from pdd.router.decide.routing import Decision
from pdd.router.fleet.pool import WorkerPool

ROLES = {"p0": "prefill", "rld0": "relay_decode", "md0": "main_decode"}


def test_blocks_routed_since_the_last_stats_are_not_offered_again():
    """A 40-token p_rld_md request (4-token blocks; MD holds 8 tokens): until the workers'
    next Stats (which count them, and reset this), P's and RLD's room shrinks by its 10 blocks
    and MD's by the 8 it lacks: a burst within one poll does not count the same free blocks
    twice."""
    cfg = PddConfig.model_validate({
        "router": {"mode": "pdd"},
        "workers": [{"id": w, "role": r, "port": 7000 + i} for i, (w, r) in enumerate(ROLES.items())],
    })  # fmt: skip
    pool = WorkerPool(cfg)
    for st in pool._members.states.values():  # what the health poll fills in
        st.stats = worker_pb2.StatsResponse(block_size=4, kv_arena_blocks=16, kv_free_blocks=16)
    decision = Decision(
        Pipeline.P_RLD_MD,
        ((Role.PREFILL, "p0"), (Role.RELAY_DECODE, "rld0"), (Role.MAIN_DECODE, "md0")),
        HandoffMode.CATCH_UP, md_cached_tokens=8, block_size=4,
    )  # fmt: skip
    pool.note_routed(decision, list(range(40)))
    free = {w.id: w.kv_free_blocks for w in pool.view().workers}
    assert free == {"p0": 6, "rld0": 6, "md0": 8}
    pool.note_routed(decision, list(range(40)))  # a second one: no room is left below zero
    assert {w.id: w.kv_free_blocks for w in pool.view().workers} == {"p0": 0, "rld0": 0, "md0": 0}
