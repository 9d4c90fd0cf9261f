"""PddConnector's two halves without an engine (fast).

The worker half copies for real between torch tensors shaped like vLLM's CPU KV cache and a
real shared-memory arena. The scheduler half runs on real vLLM ``Request`` objects; only the
block table and the scheduler output are small fakes (its inputs are plain data).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from pdd.cache.arena import FenceBoard, SlotArena
from pdd.engine.connector_meta import CopyJob, PddConnectorMetadata
from pdd.engine.connector_params import (
    ConnectorSettings,
    ExportParams,
    FenceRef,
    LoadParams,
    wrap,
)
from pdd.engine.connector_scheduler import SchedulerHalf
from pdd.engine.connector_worker import HeadShard, WorkerHalf
from pdd.errors import ConfigError

BLOCK = 32
LAYERS = 3
SHAPE = (8, 3, BLOCK, 128)  # [num_blocks, num_kv_heads, block_size, 2*head_dim] per layer
PREFIX = "pddtest-conn"


def _caches(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(SHAPE, generator=g).to(dtype) for i in range(LAYERS)}


def _slot_bytes(dtype=torch.float32) -> int:
    return LAYERS * SHAPE[1] * SHAPE[2] * SHAPE[3] * torch.tensor([], dtype=dtype).element_size()


@pytest.fixture
def arenas():
    made: list = []

    def make(num_slots: int, dtype=torch.float32, fences: int = 0) -> ConnectorSettings:
        arena = SlotArena.create(num_slots, _slot_bytes(dtype), PREFIX)
        made.append(arena)
        board = None
        if fences:
            board = FenceBoard.create(fences, PREFIX)
            made.append(board)
        return ConnectorSettings(arena=arena.ref, fences=board.ref if board else None)

    yield make
    for a in made:
        a.close()
        a.unlink()


def _worker(settings: ConnectorSettings, caches, shard: HeadShard | None = None) -> WorkerHalf:
    half = WorkerHalf(settings, shard=shard)
    half.register_kv_caches(caches)
    return half


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_through_non_contiguous_slots_byte_exact(arenas, dtype):
    settings = arenas(6, dtype)
    src, dst = _caches(1, dtype), _caches(2, dtype)
    p, d = _worker(settings, src), _worker(settings, dst)
    try:
        p.save(PddConnectorMetadata(saves=[CopyJob("r", (5, 1, 6), (4, 0, 2))]))
        d.load(PddConnectorMetadata(loads=[CopyJob("r", (0, 3, 7), (4, 0, 2))]))
        untouched = _caches(2, dtype)
        for name in src:
            assert torch.equal(dst[name][[0, 3, 7]], src[name][[5, 1, 6]])
            assert torch.equal(dst[name][[1, 2, 4, 5, 6]], untouched[name][[1, 2, 4, 5, 6]])
        assert p.take_worker_meta().saves["r"].blocks == 3
        assert d.take_worker_meta().loads["r"].blocks == 3
        assert p.take_worker_meta() is None
    finally:
        p.shutdown()
        d.shutdown()


def test_slot_layout_is_layer_order_of_raw_block_bytes(arenas):
    settings = arenas(2)
    src = _caches(3)
    half = _worker(settings, src)
    try:
        half.save(PddConnectorMetadata(saves=[CopyJob("r", (4,), (1,))]))
        view = SlotArena.attach_ref(settings.arena)
        want = b"".join(t[4].numpy().tobytes() for t in src.values())
        assert bytes(view.view(1)) == want
        view.close()
    finally:
        half.shutdown()


def test_an_arena_of_the_wrong_slot_size_fails_engine_start(arenas):
    settings = arenas(2, torch.bfloat16)
    with pytest.raises(ConfigError, match="one KV block of this engine is 147456 bytes"):
        WorkerHalf(settings).register_kv_caches(_caches(1, torch.float32))


def test_fences_are_posted_at_the_start_of_a_step(arenas):
    settings = arenas(2, fences=4)
    half = _worker(settings, _caches(1))
    board = FenceBoard.attach(settings.fences)
    try:
        half.load(PddConnectorMetadata(fences=[(2, 7), (0, 9)]))
        assert [board.read(i) for i in range(4)] == [9, 0, 7, 0]
    finally:
        board.close()
        half.shutdown()


def test_export_progress_is_posted_once_every_ranks_copies_are_in(arenas):
    """P streams its blocks while it prefills: a step's saves report how far each exporting
    request's slots are filled, and the scheduler half posts it to the progress board once the
    step's reports (every rank's, aggregated by vLLM) are in; the bytes are there by then."""
    settings = arenas(4)
    progress = FenceBoard.create(4, PREFIX)
    settings = settings.model_copy(update={"progress": progress.ref})
    caches = _caches(3)
    half = _worker(settings, caches)
    sched = SchedulerHalf(settings, BLOCK, producer=True, consumer=False)
    arena = SlotArena.attach_ref(settings.arena)
    try:
        half.save(PddConnectorMetadata(saves=[CopyJob("r", (5, 1), (2, 0), (3, 2))]))
        meta = half.take_worker_meta()
        assert meta.progress == {3: 2} and progress.read(3) == 0  # not posted by a rank
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
        assert [progress.read(i) for i in range(4)] == [0, 0, 0, 2]
        assert bytes(arena.view(2)) == b"".join(t[5].numpy().tobytes() for t in caches.values())
    finally:
        arena.close()
        sched.close()
        progress.close()
        progress.unlink()
        half.shutdown()


def _blocks_outer(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values stored [blocks, layers, heads, block_size, 2*head_dim] (vLLM's BLHNC
    layout on GPUs: every layer of a block together): each layer's view strides over blocks,
    not vLLM's CPU layout, so the worker half copies them with the torch copier."""
    one = torch.stack(list(caches.values()), dim=1)
    return {n: one[:, i] for i, n in enumerate(caches)}


@pytest.mark.parametrize("stored", ["cpu-packed", "blocks-outer"])
@pytest.mark.parametrize("world", [3, 6])
def test_tensor_parallel_ranks_each_copy_their_heads_of_whole_slots(arenas, world, stored):
    """A slot holds every KV head whatever the tensor-parallel degree: P's ranks (3 heads over
    3 ranks, or replicated over 6) fill it with the bytes one rank would write, and MD's ranks
    each load only their own heads from it; in vLLM's CPU layout (numpy copier) and in a
    strided one (torch copier, as on GPUs)."""
    settings = arenas(3)
    whole, shard_of = _caches(4), lambda r: HeadShard.of_rank(r, world, SHAPE[1])
    lay = _blocks_outer if stored == "blocks-outer" else dict
    ranks = [lay({n: t[:, s.start : s.start + s.count].clone() for n, t in whole.items()})
             for s in map(shard_of, range(world))]  # fmt: skip
    one = _worker(settings, _caches(4))
    p = [_worker(settings, c, shard_of(r)) for r, c in enumerate(ranks)]
    copier = "TorchBlockCopier" if stored == "blocks-outer" else "SlotCopier"
    assert {type(half._copier).__name__ for half in p} == {copier}
    loaded = [lay({n: torch.zeros_like(t) for n, t in c.items()}) for c in ranks]
    md = [_worker(settings, c, shard_of(r)) for r, c in enumerate(loaded)]
    arena = SlotArena.attach_ref(settings.arena)
    try:
        one.save(PddConnectorMetadata(saves=[CopyJob("r", (6,), (0,))]))
        for half in p:
            half.save(PddConnectorMetadata(saves=[CopyJob("r", (6,), (1,))]))
        assert bytes(arena.view(1)) == bytes(arena.view(0))
        for half in md:
            half.load(PddConnectorMetadata(loads=[CopyJob("r", (2,), (1,))]))
        for r, c in enumerate(loaded):
            s = shard_of(r)
            for n, t in c.items():
                assert torch.equal(t[2], whole[n][6, s.start : s.start + s.count])
        a, b = (half.take_worker_meta() for half in p[:2])
        both = a.aggregate(b)  # vLLM's sum over ranks: the same block, copied in parallel
        assert both.saves["r"].blocks == 1
        assert both.saves["r"].seconds == max(a.saves["r"].seconds, b.saves["r"].seconds)
    finally:
        arena.close()
        for half in [one, *p, *md]:
            half.shutdown()


def test_a_rank_whose_heads_do_not_match_its_cache_fails_engine_start(arenas):
    settings = arenas(2)
    with pytest.raises(ConfigError, match="expected 1 heads first"):
        WorkerHalf(settings, shard=HeadShard.of_rank(0, 3, 3)).register_kv_caches(_caches(1))
    with pytest.raises(ConfigError, match="3 KV heads cannot be split over 2 ranks"):
        HeadShard.of_rank(0, 2, 3)


# ---- scheduler half --------------------------------------------------------------------------


def _request(rid: str, n: int, pdd: dict | None) -> Request:
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": pdd} if pdd else None)
    return Request(rid, list(range(100, 100 + n)), sp, None)


class _Table:
    """Block table fake: request id -> its block ids (vLLM's get_block_ids shape)."""

    def __init__(self, ids: dict[str, list[int]]) -> None:
        self.ids = ids

    def get_block_ids(self, rid: str | None = None):
        return (self.ids[rid],)


def _sched(num_slots=16, fences=4, producer=True, consumer=True) -> SchedulerHalf:
    arena = {"name": "x", "num_slots": num_slots, "slot_bytes": 8}
    board = {"name": "y", "num_slots": fences, "slot_bytes": 8} if fences else None
    settings = ConnectorSettings.model_validate({"arena": arena, "fences": board})
    return SchedulerHalf(settings, BLOCK, producer, consumer)


def _step(s: SchedulerHalf, req: Request, n: int) -> PddConnectorMetadata:
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={req.request_id: n}))
    req.num_computed_tokens += n
    return meta


def test_export_copies_each_block_in_the_step_that_completes_it():
    s = _sched()
    req = _request("p", 200, wrap(export=ExportParams(slots=[9, 8, 7, 6, 5], fence=FenceRef(
        index=1, ticket=5))))  # fmt: skip
    s.bind(_Table({"p": [40, 41, 42, 43, 44, 45, 46]}))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, None, 0)
    saves = [_step(s, req, 80).saves, _step(s, req, 40).saves, _step(s, req, 80).saves]
    assert saves == [
        [CopyJob("p", (40, 41), (9, 8), (1, 2))],  # tokens 0-79: blocks 0-1 whole
        [CopyJob("p", (42,), (7,), (1, 3))],  # tokens 80-119: block 2 whole (96)
        [CopyJob("p", (43, 44), (6, 5), (1, 5))],  # 120-199: blocks 3-4 whole; 6 not slotted
    ]  # each posts how far the request's slots are filled to its fence's progress word
    assert s.request_finished(req) == (False, {"pdd": {"exported": {
        "num_blocks": 5, "num_tokens": 160, "complete": True, "error": None}}})  # fmt: skip
    assert s.build_meta(SimpleNamespace(num_scheduled_tokens={})).fences == [(1, 5)]


def test_load_covers_slotted_blocks_past_the_local_hit_and_leaves_one_token():
    s = _sched()
    req = _request("d", 128, wrap(load=LoadParams(slots=[3, 2, 1, 0])))
    assert s.get_num_new_matched_tokens(req, 32) == (127 - 32, False)  # 4 whole blocks: 127
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13],))
    s.update_state_after_alloc(req, blocks, 95)
    meta = _step(s, req, 1)
    assert meta.loads == [CopyJob("d", (11, 12, 13), (2, 1, 0))]
    _, params = s.request_finished(req)
    assert params == {"pdd": {"loaded": {"num_blocks": 3, "first_block": 1, "num_tokens": 127,
                                         "ok": True, "seconds": None, "error": None}}}  # fmt: skip


def test_the_prompts_tail_block_is_exported_with_the_last_chunk_and_loaded_to_its_end():
    """A prompt of 100 tokens (3 whole blocks and 4 tokens): P copies the block cut short once
    the whole prompt is computed; a consumer given its slot and ``tokens`` (the sender's
    prompt) loads exactly those tokens and computes only what follows (P's token)."""
    s = _sched()
    req = _request("p", 100, wrap(export=ExportParams(slots=[9, 8, 7, 6])))
    s.bind(_Table({"p": [40, 41, 42, 43]}))
    s.update_state_after_alloc(req, None, 0)
    saves = [_step(s, req, 64).saves, _step(s, req, 30).saves, _step(s, req, 6).saves]
    assert saves == [
        [CopyJob("p", (40, 41), (9, 8))],
        [],  # tokens 64-93: block 2 not whole yet, the prompt not done
        [CopyJob("p", (42, 43), (7, 6))],  # block 2 whole, and the tail: the prompt is done
    ]
    assert s.request_finished(req)[1]["pdd"]["exported"] == {
        "num_blocks": 4, "num_tokens": 100, "complete": True, "error": None}  # fmt: skip
    d = _request("d", 101, wrap(load=LoadParams(slots=[3, 2, 1, 0], tokens=100)))
    assert s.get_num_new_matched_tokens(d, 0) == (100, False)  # P's token is computed
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13],))
    s.update_state_after_alloc(d, blocks, 100)
    assert _step(s, d, 1).loads == [CopyJob("d", (10, 11, 12, 13), (3, 2, 1, 0))]
    assert s.request_finished(d)[1]["pdd"]["loaded"]["num_tokens"] == 100
    longer = _request("d2", 140, wrap(load=LoadParams(slots=[3, 2, 1, 0], tokens=100)))
    assert s.get_num_new_matched_tokens(longer, 0) == (100, False)  # never past the tail


def test_a_request_loads_once_and_computes_after_a_preemption():
    """The shell frees the slots at the first token, so a preempted request scheduled again
    must not read them: vLLM computes what it lost."""
    s = _sched()
    req = _request("d", 128, wrap(load=LoadParams(slots=[3, 2, 1, 0])))
    assert s.get_num_new_matched_tokens(req, 0) == (127, False)
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13],))
    s.update_state_after_alloc(req, blocks, 127)
    assert _step(s, req, 1).loads == [CopyJob("d", (10, 11, 12, 13), (3, 2, 1, 0))]
    req.num_computed_tokens = 0  # preempted: its blocks are gone
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, blocks, 0)
    assert _step(s, req, 128).loads == []


def test_an_export_from_a_first_block_saves_only_the_blocks_after_it():
    s = _sched()
    req = _request("md", 200, wrap(export=ExportParams(slots=[9, 8, 7], first_block=3)))
    s.bind(_Table({"md": [40, 41, 42, 43, 44, 45, 46]}))
    assert s.get_num_new_matched_tokens(req, 192) == (0, False)
    s.update_state_after_alloc(req, None, 0)
    req.num_computed_tokens = 192  # vLLM's prefix cache held 6 blocks
    assert _step(s, req, 8).saves == [CopyJob("md", (43, 44, 45), (9, 8, 7))]
    assert s.request_finished(req)[1]["pdd"]["exported"] == {
        "num_blocks": 6, "num_tokens": 192, "complete": True, "error": None}  # fmt: skip


@pytest.mark.parametrize(
    ("params", "producer", "error"),
    [
        (wrap(load=LoadParams(slots=list(range(5)))), False, "only 4 blocks"),
        (wrap(load=LoadParams(slots=[0, 1], tokens=30)), False, "do not end in the last"),
        (wrap(load=LoadParams(slots=[0, 16])), False, "slot 16 out of range"),
        (wrap(load=LoadParams(slots=[0], fence=FenceRef(index=4, ticket=1))), False, "fence"),
        (wrap(load=LoadParams(slots=[0])), True, "not a kv_consumer"),
    ],
)
def test_refused_loads_compute_everything_and_say_why(params, producer, error):
    s = _sched(producer=producer, consumer=not producer)
    req = _request("d", 127, params)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, None, 0)
    assert _step(s, req, 127).loads == []
    loaded = s.request_finished(req)[1]["pdd"]["loaded"]
    assert (loaded["ok"], loaded["num_blocks"]) == (False, 0)
    assert error in loaded["error"]


def test_refused_export_copies_nothing_but_still_posts_its_fence():
    s = _sched(num_slots=2)
    req = _request("p", 100, wrap(export=ExportParams(slots=[0, 2], fence=FenceRef(
        index=0, ticket=3))))  # fmt: skip
    s.bind(_Table({"p": [1, 2, 3, 4]}))
    s.update_state_after_alloc(req, None, 0)
    assert _step(s, req, 100).saves == []
    exported = s.request_finished(req)[1]["pdd"]["exported"]
    assert (exported["complete"], exported["num_blocks"]) == (False, 0)
    assert "slot 2 out of range" in exported["error"]
    assert s.build_meta(SimpleNamespace(num_scheduled_tokens={})).fences == [(0, 3)]


def test_a_request_aborted_before_it_was_scheduled_still_posts_its_fence():
    s = _sched()
    req = _request("d", 100, wrap(load=LoadParams(slots=[0], fence=FenceRef(index=2, ticket=8))))
    assert s.request_finished(req)[1]["pdd"]["loaded"]["num_blocks"] == 0
    assert s.build_meta(SimpleNamespace(num_scheduled_tokens={})).fences == [(2, 8)]


def test_requests_without_pdd_params_are_left_alone():
    s = _sched()
    req = _request("x", 100, None)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.request_finished(req) == (False, None)
