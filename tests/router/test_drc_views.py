"""The router's DRC views: snapshot / events / resync against a scripted DrcEvents source."""

from __future__ import annotations

import asyncio
import logging

from pdd.cache.hashing import block_hashes, model_salt
from pdd.cache.messages import BlockRemoved, BlockStored, DrcEventBatch, DrcSnapshot
from pdd.config import ModelConfig
from pdd.errors import UnavailableError
from pdd.proto import worker_pb2
from pdd.router.fleet.drc_views import DrcViews

BS = 4
MODEL = ModelConfig()
SALT = model_salt(MODEL.name, MODEL.dtype, BS)
PROMPT = list(range(100, 118))  # 4 whole blocks + 2 tokens
H = block_hashes(PROMPT, BS, SALT)


class Source:
    """Answers DrcEvents from a scripted list; records each ``since``."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls: list[int] = []

    async def drc_events(self, since: int) -> worker_pb2.DrcEventsResponse:
        self.calls.append(since)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, str):
            return worker_pb2.DrcEventsResponse(json=answer)
        snapshot = isinstance(answer, DrcSnapshot)
        return worker_pb2.DrcEventsResponse(json=answer.model_dump_json(), snapshot=snapshot)


def snap(seq, hashes, epoch="e1"):
    return DrcSnapshot(epoch=epoch, seq=seq, block_size=BS, block_hashes=tuple(hashes))


def batch(last_seq, *events, epoch="e1"):
    return DrcEventBatch(epoch=epoch, block_size=BS, last_seq=last_seq, events=events)


def refresh(views, source):
    asyncio.run(views.refresh("md0", source))  # type: ignore[arg-type]


def test_first_refresh_takes_a_snapshot_and_answers_prefix_hits():
    views = DrcViews(["md0", "md1"], MODEL)
    assert views.cached_tokens(PROMPT) == {"md0": 0, "md1": 0}
    src = Source(snap(3, H[:2]))
    refresh(views, src)
    assert src.calls == [-1]
    assert views.cached_tokens(PROMPT) == {"md0": 8, "md1": 0}
    assert views.describe("md0") == {"blocks": 2, "seq": 3, "stale": False}


def test_events_follow_the_sequence():
    views = DrcViews(["md0"], MODEL)
    stored = BlockStored(seq=4, parent_hash=H[1], block_hashes=tuple(H[2:4]))
    removed = BlockRemoved(seq=5, block_hashes=(H[3],))
    src = Source(snap(3, H[:2]), batch(4, stored), batch(5, removed), batch(5))
    for _ in range(4):
        refresh(views, src)
    assert src.calls == [-1, 3, 4, 5]
    assert views.cached_tokens(PROMPT) == {"md0": 12}


def test_a_gap_or_a_new_epoch_resyncs_at_once():
    views = DrcViews(["md0"], MODEL)
    gap = BlockStored(seq=5, parent_hash=None, block_hashes=(H[0],))
    src = Source(snap(3, []), batch(5, gap), snap(5, H), batch(0, epoch="e2"), snap(0, [], "e2"))
    refresh(views, src)
    refresh(views, src)  # seq 4 is missing: snapshot in the same refresh
    assert src.calls == [-1, 3, -1]
    assert views.cached_tokens(PROMPT) == {"md0": 16}
    refresh(views, src)  # the MD restarted: another epoch
    assert src.calls == [-1, 3, -1, 5, -1]
    assert views.cached_tokens(PROMPT) == {"md0": 0}


def test_an_unanswered_or_garbled_refresh_keeps_the_view_and_retries(caplog):
    views = DrcViews(["md0"], MODEL)
    src = Source(snap(1, H[:1]), UnavailableError("down"), "not json", batch(1), batch(1))
    with caplog.at_level(logging.WARNING, logger="pdd.router.fleet.drc_views"):
        for _ in range(4):
            refresh(views, src)
    assert src.calls == [-1, 1, 1, 1]
    assert views.cached_tokens(PROMPT) == {"md0": 4}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("DRC view of md0 not refreshed: down")


def test_blocks_of_another_model_never_hit():
    views = DrcViews(["md0"], ModelConfig(name="other-model"))
    refresh(views, Source(snap(1, H)))
    assert views.cached_tokens(PROMPT) == {"md0": 0}
