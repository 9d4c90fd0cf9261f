"""PddConnector end to end: a real producer engine (P) and a real consumer engine (D).

Both are pdd.engine.engine.Engine (vLLM AsyncLLM, engine core + worker in child processes)
on the default model in float32, joined by the shm KV channel in a /dev/shm tmp dir. The
oracle is P's own greedy run of the same prompt (a single engine, no connector traffic).
Each test uses a fresh prompt so that neither engine's prefix cache can answer for the channel.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from pdd.config import EngineConfig, ModelConfig
from pdd.engine.connector_params import ExportParams, LoadParams, wrap
from pdd.engine.engine import Engine
from pdd.engine.types import EngineDelta, KvConnectorSpec, SamplingSpec

pytestmark = pytest.mark.slow

BLOCK = 32
PREFILL_CHUNK = 128
VOCAB_LO, VOCAB_HI = 200, 40000


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def _model() -> ModelConfig:
    fp32 = ModelConfig(dtype="float32")
    return fp32 if fp32.resolved_path().is_dir() else ModelConfig(dtype="bfloat16")


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def store():
    root = tempfile.mkdtemp(prefix="pdd-kv-test-", dir="/dev/shm")
    yield Path(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def engines(loop, store):
    settings = {
        "channel": {"kind": "shm", "options": {"root": str(store)}},
        "lease_s": 10.0,
        "load_deadline_s": 30.0,
    }
    cfg = {"max_model_len": 2048, "kv_cache_space_gib": 0.25, "block_size": BLOCK}
    # P prefills in 128-token chunks: a fresh prompt is exported over several engine steps.
    p_cfg = EngineConfig(**cfg, max_num_batched_tokens=PREFILL_CHUNK)
    p = Engine(_model(), p_cfg, KvConnectorSpec(role="kv_producer", extra_config=settings))
    d = Engine(
        _model(), EngineConfig(**cfg), KvConnectorSpec(role="kv_consumer", extra_config=settings)
    )
    try:
        loop.run_until_complete(p.start())
        loop.run_until_complete(d.start())
        yield p, d
    finally:
        loop.run_until_complete(d.stop())
        loop.run_until_complete(p.stop())


async def _run(engine: Engine, rid: str, prompt: list[int], n: int, params=None):
    """Greedy-decode ``n`` tokens; the token ids and the final delta."""
    spec = SamplingSpec(temperature=0.0, max_tokens=n, ignore_eos=True)
    tokens: list[int] = []
    last: EngineDelta | None = None
    async for delta in engine.generate(rid, prompt, spec, kv_transfer_params=params):
        tokens += delta.token_ids
        last = delta
    assert last is not None and last.finished
    return tokens, last


def _wait_no_blocks_in_use(loop, engine: Engine, deadline_s: float = 20.0) -> None:
    """Poll (with a deadline) until the engine reports no KV block in use."""
    end = time.monotonic() + deadline_s
    while engine.stats().kv_cache_usage != 0.0:
        assert time.monotonic() < end, f"blocks still held: usage {engine.stats().kv_cache_usage}"
        # A tiny request makes the engine step and publish fresh stats.
        loop.run_until_complete(_run(engine, f"probe-{time.monotonic_ns()}", [11, 12], 1))


def _export(loop, p: Engine, rid: str, prompt: list[int], transfer_id: str):
    params = wrap(export=ExportParams(transfer_id=transfer_id))
    tokens, last = loop.run_until_complete(_run(p, rid, prompt, 1, params))
    return tokens, last.kv_transfer_params["pdd"]["exported"]


def _seal(store: Path, transfer_id: str, deadline_s: float = 20.0) -> dict:
    path = store / transfer_id / "sealed.json"
    end = time.monotonic() + deadline_s
    while not path.exists():
        assert time.monotonic() < end, f"{transfer_id} never sealed"
        time.sleep(0.01)
    return json.loads(path.read_bytes())


def test_d_decodes_from_p_kv_like_a_single_engine(loop, engines, store):
    p, d = engines
    prompt = _prompt(1, 450)  # 14 whole blocks + a 2-token tail; 4 prefill chunks on P
    first, exported = _export(loop, p, "p-1", prompt, "t-1")
    assert exported == {"transfer_id": "t-1", "num_tokens": 450, "num_blocks": 15, "complete": True}
    seal = _seal(store, "t-1")
    assert (seal["num_tokens"], seal["num_blocks"]) == (450, 15)
    want, _ = loop.run_until_complete(_run(p, "base-1", prompt, 12))
    assert first == want[:1]

    load = wrap(load=LoadParams(transfer_id="t-1", num_tokens=450))
    got, last = loop.run_until_complete(_run(d, "d-1", prompt, 12, load))
    assert got == want
    loaded = last.kv_transfer_params["pdd"]["loaded"]
    assert (loaded["ok"], loaded["num_tokens"], loaded["num_blocks"]) == (True, 450, 15)
    assert 450 - last.num_cached_tokens <= 450 % BLOCK  # D computed only the tail itself
    print(
        f"\nexport 450 tok: {seal['sealed_at'] - seal['opened_at']:.4f} s, {seal['bytes']} B; "
        f"load: {loaded['seconds']:.4f} s; D cached {last.num_cached_tokens}"
    )
    _wait_no_blocks_in_use(loop, p)
    _wait_no_blocks_in_use(loop, d)


def test_failed_load_is_recomputed(loop, engines):
    p, d = engines
    prompt = _prompt(2, 380)
    want, _ = loop.run_until_complete(_run(p, "base-2", prompt, 8))

    load = wrap(load=LoadParams(transfer_id="t-missing", num_tokens=380, deadline_s=0.5))
    got, last = loop.run_until_complete(_run(d, "d-2", prompt, 8, load))
    assert got == want
    loaded = last.kv_transfer_params["pdd"]["loaded"]
    assert loaded["ok"] is False and loaded["error"].startswith("TransferTimeout")
    assert last.num_cached_tokens == 0
    _wait_no_blocks_in_use(loop, d)


def test_extend_recomputes_only_the_new_tokens(loop, engines, store):
    p, d = engines
    prompt = _prompt(3, 520)  # 16 whole blocks + an 8-token tail
    want, _ = loop.run_until_complete(_run(p, "base-3", prompt, 16))
    _export(loop, p, "p-3", prompt, "t-3")
    _seal(store, "t-3")

    k = 5  # tokens "RLD" emitted; D gets prompt + those, with the prompt's KV loaded
    load = wrap(load=LoadParams(transfer_id="t-3", num_tokens=len(prompt)))
    got, last = loop.run_until_complete(_run(d, "d-3", prompt + want[:k], 16 - k, load))
    assert got == want[k:]
    loaded = last.kv_transfer_params["pdd"]["loaded"]
    assert (loaded["ok"], loaded["num_tokens"], loaded["num_blocks"]) == (True, 520, 17)
    assert last.num_cached_tokens == len(prompt)  # only the k new tokens were computed
    _wait_no_blocks_in_use(loop, p)
    _wait_no_blocks_in_use(loop, d)
