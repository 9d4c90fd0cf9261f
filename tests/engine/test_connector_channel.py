"""PddConnector's worker half and the shm KV channel, without an engine (fast).

The shm channel runs for real on a /dev/shm tmp dir. The ownership tests plug a scripted sink
in through the channel plug-in contract (``kind`` = an importable module with make_sink /
make_source), the same way pdd.transfer plugs in.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
import torch

from pdd.engine.connector_channel import SendState
from pdd.engine.connector_meta import ExportJob, LoadJob, PddConnectorMetadata
from pdd.engine.connector_params import ConnectorSettings
from pdd.engine.connector_shm import make_sink, make_source
from pdd.engine.connector_worker import PagedKv, WorkerHalf
from pdd.errors import IntegrityError, TransferCancelled, TransferError

BLOCK = 32
SHAPE = (8, 3, BLOCK, 128)  # [num_blocks, num_kv_heads, block_size, 2*head_dim] per layer


def _caches(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(SHAPE, generator=g).to(dtype) for i in range(3)}


def _poll(fn, deadline_s: float = 5.0):
    end = time.monotonic() + deadline_s
    while not (value := fn()):
        assert time.monotonic() < end, "condition not reached before the deadline"
        time.sleep(0.002)
    return value


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(prefix="pdd-kv-unit-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_shm_stream_lands_blocks_byte_exact(root):
    src, dst = _caches(1), _caches(2)
    p, d = PagedKv(src, BLOCK), PagedKv(dst, BLOCK)
    sink = make_sink({"root": str(root)}, p.layout)
    source = make_source({"root": str(root)}, d.layout)
    try:
        sink.open("t")
        for index, block_id in enumerate([5, 1, 6]):
            sink.offer("t", index, p.block(block_id))
        sink.seal("t", 70)
        _poll(lambda: sink.poll("t") is SendState.DONE)
        for index, block_id in enumerate([0, 2, 3]):
            source.fetch("t", index, d.block(block_id), time.monotonic() + 1)
        for name in src:
            assert torch.equal(dst[name][[0, 2, 3]], src[name][[5, 1, 6]])
            assert torch.equal(dst[name][1], _caches(2)[name][1])  # untouched block
        with pytest.raises(TransferError, match="no block 9"):  # past the sealed end
            source.fetch("t", 9, d.block(4), time.monotonic() + 5)
    finally:
        sink.close()


def test_shm_cancel_fails_the_consumer_fast(root):
    p = PagedKv(_caches(1), BLOCK)
    sink = make_sink({"root": str(root)}, p.layout)
    source = make_source({"root": str(root)}, p.layout)
    try:
        sink.open("t")
        sink.cancel("t")
        assert sink.poll("t") is SendState.CANCELLED
        started = time.monotonic()
        with pytest.raises(TransferCancelled):
            source.fetch("t", 0, p.block(0), time.monotonic() + 5)
        assert time.monotonic() - started < 1.0
    finally:
        sink.close()


def test_shm_refuses_a_different_layout(root):
    p, d = PagedKv(_caches(1), BLOCK), PagedKv(_caches(2, torch.bfloat16), BLOCK)
    sink = make_sink({"root": str(root)}, p.layout)
    try:
        sink.open("t")
        sink.offer("t", 0, p.block(0))
        sink.seal("t", 32)
        _poll(lambda: sink.poll("t") is SendState.DONE)
        with pytest.raises(IntegrityError):
            make_source({"root": str(root)}, d.layout).fetch("t", 0, d.block(0), time.monotonic())
    finally:
        sink.close()


class ScriptedSink:
    """A sink whose streams stay PENDING until the test says otherwise; records every call."""

    def __init__(self) -> None:
        self.state: dict[str, SendState] = {}
        self.offered: list[tuple[str, int]] = []
        self.cancelled: list[str] = []
        self.released: list[str] = []

    def open(self, transfer_id):
        self.state[transfer_id] = SendState.PENDING

    def offer(self, transfer_id, block_index, block):
        self.offered.append((transfer_id, block_index))

    def seal(self, transfer_id, num_tokens):
        pass

    def poll(self, transfer_id):
        return self.state[transfer_id]

    def cancel(self, transfer_id):
        self.cancelled.append(transfer_id)
        self.state[transfer_id] = SendState.CANCELLED

    def release(self, transfer_id):
        self.released.append(transfer_id)
        del self.state[transfer_id]

    def close(self):
        pass


@pytest.fixture
def scripted():
    sink = ScriptedSink()
    module = types.ModuleType("pdd_test_scripted_channel")
    module.make_sink = lambda options, layout: sink
    module.make_source = lambda options, layout: None
    sys.modules[module.__name__] = module
    yield sink
    del sys.modules[module.__name__]


def _producer(lease_s: float) -> WorkerHalf:
    settings = ConnectorSettings.model_validate(
        {"channel": {"kind": "pdd_test_scripted_channel"}, "lease_s": lease_s}
    )
    half = WorkerHalf(settings, BLOCK, producer=True, consumer=False)
    half.register_kv_caches(_caches(1))
    return half


def _job(lease_s: float) -> ExportJob:
    return ExportJob("r1", "t1", 0, (3, 4), open=True, seal_num_tokens=40, lease_s=lease_s)


def test_blocks_are_held_until_the_stream_ends_then_reported_once(scripted):
    half = _producer(lease_s=60)
    half.export(PddConnectorMetadata(exports=[_job(60)]))
    assert scripted.offered == [("t1", 0), ("t1", 1)]
    assert half.transfer_results(set()).finished_sending == set()  # request still running
    assert half.transfer_results({"r1"}).finished_sending == set()  # finished, still sending
    scripted.state["t1"] = SendState.DONE
    assert half.transfer_results(set()).finished_sending == {"r1"}
    assert half.transfer_results(set()).finished_sending == set()
    assert scripted.released == ["t1"] and scripted.cancelled == []
    meta = half.take_worker_meta()
    assert [(s.req_id, s.state) for s in meta.sends] == [("r1", "done")]


def test_lease_expiry_cancels_the_stream_and_frees_the_blocks(scripted):
    half = _producer(lease_s=0.05)
    half.export(PddConnectorMetadata(exports=[_job(0.05)]))
    assert half.transfer_results({"r1"}).finished_sending == set()
    _poll(lambda: half.transfer_results(set()).finished_sending == {"r1"})
    assert scripted.cancelled == ["t1"] and scripted.released == ["t1"]
    assert [s.state for s in half.take_worker_meta().sends] == ["lease_expired"]


def test_scheduler_cancel_stops_the_stream_before_the_forward(scripted):
    half = _producer(lease_s=60)
    half.export(PddConnectorMetadata(exports=[_job(60)]))
    half.apply_cancels(PddConnectorMetadata(cancels=["r1", "unknown"]))
    assert scripted.cancelled == ["t1"]
    assert half.transfer_results({"r1"}).finished_sending == {"r1"}
    assert [s.state for s in half.take_worker_meta().sends] == ["cancelled"]


def test_every_load_ends_in_exactly_one_result(root):
    settings = ConnectorSettings.model_validate({"channel": {"options": {"root": str(root)}}})
    half = WorkerHalf(settings, BLOCK, producer=False, consumer=True)
    half.register_kv_caches(_caches(2))
    try:
        job = LoadJob("r9", "t-absent", 0, (1, 2), num_tokens=64, deadline_s=0.05)
        half.start_loads(PddConnectorMetadata(loads=[job]))
        res = _poll(lambda: (r := half.transfer_results(set())).finished_recving and r)
        assert (res.finished_recving, res.failed_recving) == ({"r9"}, {"r9"})
        result = half.take_worker_meta().loads["r9"]
        assert (result.ok, result.num_blocks) == (False, 2)
        assert result.error.startswith("TransferTimeout")
        assert half.transfer_results(set()).finished_recving == set()
    finally:
        half.shutdown()
