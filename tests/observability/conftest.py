"""Fixtures for the observability tests: the default model's tokenizer, and a PDD router
(P, RLD, MD) on fake workers whose Stats report DRC and WAN numbers (``StatsFake``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdd.config import ModelConfig
from pdd.observability.context import REQUEST_ID_METADATA as HEADER
from pdd.proto import worker_pb2
from pdd.router.text.tokenizer import TextCodec
from tests.router.conftest import PDD_POLICY, assert_released, fresh
from tests.router.fake_kv import FakeKvPlane
from tests.router.fake_worker import FakeWorker
from tests.router.harness import MAX_MODEL_LEN, RouterHarness

# What the fakes' Stats report (exact values the status and /debug/workers tests check).
MD_DRC = {"drc_capacity_blocks": 4000, "drc_used_blocks": 1000, "drc_query_tokens": 2000,
          "drc_hit_tokens": 1500, "drc_evictions": 7}  # fmt: skip
P_WAN = {"wan_bandwidth_bps": 93.2e6, "wan_rtt_s": 0.0201}
# P's link to md0 (its best figure above is another MD's): the router's ETA to md0 uses this
P_LINK = {"peer": "md0", "bandwidth_bps": 46.6e6, "rtt_s": 0.0302, "queued_bytes": 0}


class StatsFake(FakeWorker):
    """A fake worker whose Stats also carry ``extra`` fields (DRC, WAN, waiting, KV usage),
    and that records the ``x-request-id`` metadata of every request RPC:
    ``rpc_ids`` = [(method, the message's request id, the metadata's)]."""

    def __init__(self, *args, extra: dict | None = None, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.extra = extra or {}
        self.rpc_ids: list[tuple[str, str, str | None]] = []

    def reset(self) -> None:
        super().reset()
        self.rpc_ids = []

    def _seen(self, method: str, rid: str, context) -> None:  # type: ignore[no-untyped-def]
        self.rpc_ids.append((method, rid, dict(context.invocation_metadata()).get(HEADER)))

    async def Generate(self, request, context):  # noqa: N802
        self._seen("Generate", request.request_id, context)
        async for resp in super().Generate(request, context):
            yield resp

    async def PrepareKv(self, request, context):  # noqa: N802
        self._seen("PrepareKv", request.kv_request_id, context)
        return await super().PrepareKv(request, context)

    async def SendKv(self, request, context):  # noqa: N802
        self._seen("SendKv", request.kv_request_id, context)
        return await super().SendKv(request, context)

    async def AwaitKv(self, request, context):  # noqa: N802
        self._seen("AwaitKv", request.kv_request_id, context)
        return await super().AwaitKv(request, context)

    async def Stats(self, request, context):  # noqa: N802 (gRPC method name)
        resp = await super().Stats(request, context)
        merged = worker_pb2.StatsResponse()
        merged.CopyFrom(resp)
        for key, value in self.extra.items():
            if isinstance(value, list):  # a repeated field
                getattr(merged, key).extend(value)
            else:
                setattr(merged, key, value)
        return merged


@pytest.fixture(scope="session")
def codec() -> TextCodec:
    path = ModelConfig().resolved_path()
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"default model folder {path} is missing: run `make model` (make test does)")
    return TextCodec.from_folder(path)


def pdd_fleet(codec: TextCodec, **router: object) -> RouterHarness:
    plane = FakeKvPlane()
    fakes = [
        StatsFake("p0", MAX_MODEL_LEN, "prefill", plane,
                  extra={**P_WAN, "wan_links": [worker_pb2.WanLink(**P_LINK)]}),
        StatsFake("rld0", MAX_MODEL_LEN, "relay_decode", plane,
                  extra={"waiting_requests": 2, "kv_cache_usage": 0.25}),
        StatsFake("md0", MAX_MODEL_LEN, "main_decode", plane, extra=MD_DRC),
    ]  # fmt: skip
    return RouterHarness(codec, fakes, plane, mode="pdd", pdd=PDD_POLICY, **router)


@pytest.fixture(scope="module")
def pdd_harness(codec: TextCodec) -> Iterator[RouterHarness]:
    h = pdd_fleet(codec, debug_requests=4, sla_ttft_s=5.0, sla_tpot_s=1.0)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def pdd(pdd_harness: RouterHarness) -> Iterator[RouterHarness]:
    """Fresh scripts and an empty MD cache; afterwards nothing is left anywhere."""
    fresh(pdd_harness)
    yield pdd_harness
    assert_released(pdd_harness)
