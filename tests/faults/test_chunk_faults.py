"""Unit tests of the chunk fault rules (pdd.transfer.faulty) and the faults config, plus one
round trip over the in-process transport: a corrupted chunk fails the transfer at the
receiver's checksum and its bytes are never reported as received."""

from __future__ import annotations

import threading
import time

import pytest
from pydantic import ValidationError

from pdd.config.faults import FaultsConfig, KvChunkFault
from pdd.errors import TransferError
from pdd.transfer.faulty import ChunkFaults
from pdd.transfer.wire import ChunkHeader


def header(index: int, total: int = 1000) -> ChunkHeader:
    return ChunkHeader(
        transfer_id=1, request_id="r", chunk_index=index, chunk_count=4, segment_index=0,
        block_start=0, block_end=1, layer_start=0, layer_end=1, dtype="uint8", shape=(total,),
        offset=0, nbytes=total // 4, segment_nbytes=total, total_bytes=total,
    )  # fmt: skip


def faults(*rules: dict, kind: str = "tcp", deadline_s: float = 0.2) -> ChunkFaults:
    return ChunkFaults(kind, [KvChunkFault(**r) for r in rules], deadline_s)


def test_corrupt_hits_exactly_the_chosen_chunks_of_transfers_in_the_size_window():
    f = faults({"action": "corrupt", "chunks": [1, 3], "min_bytes": 1000, "max_bytes": 1000})
    on = f.hooks().corrupt
    assert [on(header(i)) for i in range(4)] == [False, True, False, True]
    assert [on(header(i, total=2000)) for i in range(4)] == [False] * 4
    assert f.injected == {"corrupt": 2}


def test_rules_of_another_transport_do_not_apply():
    assert not faults({"action": "corrupt"}, kind="ucx").active
    assert faults({"action": "corrupt", "transport": "any"}, kind="ucx").hooks().corrupt(header(0))


def test_probability_is_seeded_and_reproducible():
    rule = {"action": "corrupt", "probability": 0.5, "seed": 3}
    runs = [
        [f.hooks().corrupt(header(i % 4)) for i in range(40)] for f in (faults(rule), faults(rule))
    ]
    assert runs[0] == runs[1] and 5 < sum(runs[0]) < 35


def test_truncate_breaks_the_connection_and_delay_holds_the_sender():
    with pytest.raises(TransferError, match="cut at chunk 0"):
        faults({"action": "truncate"}).hooks().corrupt(header(0))
    f = faults({"action": "delay", "delay_s": 0.2, "chunks": [0]})
    t0 = time.monotonic()
    assert f.hooks().corrupt(header(0)) is False
    assert time.monotonic() - t0 >= 0.2


def test_drop_holds_until_the_deadline_or_release_then_fails():
    f = faults({"action": "drop"}, deadline_s=30)
    threading.Timer(0.1, f.release).start()  # the transport closes
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="dropped"):
        f.hooks().corrupt(header(0))
    assert time.monotonic() - t0 < 5


def test_config_is_off_by_default_and_validated():
    assert not FaultsConfig().enabled
    assert FaultsConfig(kill_after_tokens=0).enabled
    with pytest.raises(ValidationError):
        KvChunkFault(action="delay")  # needs delay_s
    with pytest.raises(ValidationError):
        FaultsConfig(kv_send=[{"action": "melt"}])
