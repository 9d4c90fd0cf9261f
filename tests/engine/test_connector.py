"""PddConnector end to end: a real producer engine (P) and a real consumer engine (D).

Both are pdd.engine.engine.Engine (vLLM AsyncLLM, connector halves in the engine-core child)
on the default model in float32. The test plays both worker shells: it owns one slot arena and
one fence board, which both engines map. The oracle is P's own greedy run of the same prompt
after its export (a single engine: the prompt's whole blocks from its prefix cache, the tail
computed), which is exactly the computation D does with the blocks loaded from slots. Each
test uses a fresh prompt so that no prefix cache answers for the arena, and its own slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from contextlib import aclosing

import pytest

from pdd.cache.arena import FenceBoard, SlotArena
from pdd.cache.host_tier import kv_block_bytes
from pdd.config import EngineConfig, ModelConfig
from pdd.engine.connector_params import ConnectorSettings, ExportParams, FenceRef, LoadParams, wrap
from pdd.engine.engine import Engine
from pdd.engine.types import EngineDelta, KvConnectorSpec, SamplingSpec
from pdd.worker.kv_run import stream_loading
from pdd.worker.roles import GenerateCall
from pdd.worker.slots import Fences

pytestmark = pytest.mark.slow

BLOCK = 32
PREFILL_CHUNK = 128
VOCAB_LO, VOCAB_HI = 200, 40000
DTYPE = "float32"


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class Shell:
    """What the worker shell owns: the arena, the fence board and the next ticket."""

    def __init__(self, dtype: str, num_slots: int) -> None:
        # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
        slot_bytes = kv_block_bytes(30, 3, 64, BLOCK, 4 if dtype == "float32" else 2)
        self.arena = SlotArena.create(num_slots, slot_bytes, "pddtest-e2e")
        self.fences = FenceBoard.create(16, "pddtest-e2e-fence")
        self.settings = ConnectorSettings(arena=self.arena.ref, fences=self.fences.ref)
        self._tickets = 0

    def fence(self, index: int) -> FenceRef:
        self._tickets += 1
        return FenceRef(index=index, ticket=self._tickets)

    def wait_fence(self, fence: FenceRef, deadline_s: float = 20.0) -> None:
        end = time.monotonic() + deadline_s
        while self.fences.read(fence.index) != fence.ticket:
            assert time.monotonic() < end, f"fence {fence} never posted"
            time.sleep(0.005)

    def close(self) -> None:
        for owned in (self.arena, self.fences):
            owned.close()
            owned.unlink()


def start_pair(loop, shell: Shell, dtype: str):
    """P (producer, 128-token prefill chunks: exports span several steps) and D (consumer)."""
    extra = shell.settings.model_dump()
    cfg = {"max_model_len": 2048, "kv_cache_space_gib": 0.25, "block_size": BLOCK}
    model = ModelConfig(dtype=dtype)
    p_cfg = EngineConfig(**cfg, max_num_batched_tokens=PREFILL_CHUNK)
    p = Engine(model, p_cfg, KvConnectorSpec(role="kv_producer", extra_config=extra))
    d_cfg = EngineConfig(**cfg, max_num_batched_tokens=PREFILL_CHUNK)
    d = Engine(model, d_cfg, KvConnectorSpec(role="kv_consumer", extra_config=extra))
    loop.run_until_complete(p.start())
    loop.run_until_complete(d.start())
    return p, d


@pytest.fixture(scope="module")
def shell():
    shell = Shell(DTYPE, num_slots=64)
    yield shell
    shell.close()


@pytest.fixture(scope="module")
def engines(loop, shell):
    p = d = None
    try:
        p, d = start_pair(loop, shell, DTYPE)
        yield p, d
    finally:
        for engine in (d, p):
            if engine is not None:
                loop.run_until_complete(engine.stop())


async def collect(engine: Engine, rid: str, prompt: list[int], n: int, params=None):
    """Greedy-decode ``n`` tokens; the token ids and the final delta."""
    spec = SamplingSpec(temperature=0.0, max_tokens=n, ignore_eos=True)
    tokens: list[int] = []
    last: EngineDelta | None = None
    async for delta in engine.generate(rid, prompt, spec, kv_transfer_params=params):
        tokens += delta.token_ids
        last = delta
    assert last is not None and last.finished
    return tokens, last


def run(loop, engine, rid, prompt, n, params=None):
    return loop.run_until_complete(collect(engine, rid, prompt, n, params))


def wait_idle(loop, engine: Engine, deadline_s: float = 20.0) -> None:
    """Poll (with a deadline) until the engine runs nothing and holds no KV block."""
    end = time.monotonic() + deadline_s
    while (s := engine.stats()).kv_cache_usage != 0.0 or s.running or s.waiting:
        assert time.monotonic() < end, f"engine not idle: {s}"
        # A tiny request makes the engine step and publish fresh stats.
        run(loop, engine, f"probe-{time.monotonic_ns()}", [11, 12], 1)


def export(loop, shell: Shell, p: Engine, rid: str, prompt: list[int], slots: list[int]):
    fence = shell.fence(0)
    params = wrap(export=ExportParams(slots=slots, fence=fence))
    tokens, last = run(loop, p, rid, prompt, 1, params)
    shell.wait_fence(fence)
    return tokens, last.kv_transfer_params["pdd"]["exported"]


def test_d_decodes_from_p_kv_like_a_single_engine(loop, engines, shell):
    p, d = engines
    prompt = prompt_of(1, 450)  # 14 whole blocks + a 2-token tail; 4 prefill chunks on P
    slots = list(range(13, -1, -1))  # block i -> slot 13 - i
    first, exported = export(loop, shell, p, "p-1", prompt, slots)
    assert exported == {"num_blocks": 14, "num_tokens": 448, "complete": True, "error": None}
    want, _ = run(loop, p, "base-1", prompt, 12)
    assert first == want[:1]

    fence = shell.fence(1)
    got, last = run(loop, d, "d-1", prompt, 12, wrap(load=LoadParams(slots=slots, fence=fence)))
    assert got == want
    loaded = last.kv_transfer_params["pdd"]["loaded"]
    assert {k: loaded[k] for k in ("ok", "num_blocks", "first_block", "num_tokens")} == {
        "ok": True, "num_blocks": 14, "first_block": 0, "num_tokens": 448}  # fmt: skip
    assert last.num_cached_tokens == 448  # D computed only the 2-token tail
    shell.wait_fence(fence)
    print(f"\nD load of 14 blocks ({14 * shell.arena.slot_bytes} B): {loaded['seconds']:.4f} s")
    wait_idle(loop, p)
    wait_idle(loop, d)


def test_extend_recomputes_only_the_tail_and_the_new_tokens(loop, engines, shell):
    p, d = engines
    prompt = prompt_of(3, 520)  # 16 whole blocks + an 8-token tail
    slots = [20 + 2 * i for i in range(16)]  # every other slot
    _, exported = export(loop, shell, p, "p-3", prompt, slots)
    assert (exported["num_blocks"], exported["complete"]) == (16, True)
    want, _ = run(loop, p, "base-3", prompt, 16)

    k = 5  # tokens "RLD" emitted; D gets prompt + those, with the prompt's blocks loaded
    got, last = run(loop, d, "d-3", prompt + want[:k], 16 - k, wrap(load=LoadParams(slots=slots)))
    assert got == want[k:]
    assert last.kv_transfer_params["pdd"]["loaded"]["num_blocks"] == 16
    assert last.num_cached_tokens == 512  # computed: 8 tail tokens + the 5 emitted ones
    wait_idle(loop, d)


def test_an_export_from_a_first_block_copies_only_the_blocks_after_it(loop, engines, shell):
    """MD storing its own blocks: its DRC holds the prompt's first 6 blocks, so it asks for
    blocks 6..9 only, into 4 slots; they hold what a whole export put in slots 6..9."""
    p, _ = engines
    prompt = prompt_of(8, 330)  # 10 whole blocks + a 10-token tail
    _, whole = export(loop, shell, p, "p-8", prompt, list(range(10)))
    assert whole["num_blocks"] == 10
    tail = [60, 61, 62, 63]
    for slot in tail:
        shell.arena.view(slot)[:] = bytes(shell.arena.slot_bytes)
    fence = shell.fence(0)
    params = wrap(export=ExportParams(slots=tail, first_block=6, fence=fence))
    _, last = run(loop, p, "p-8-tail", prompt, 1, params)
    shell.wait_fence(fence)
    exported = last.kv_transfer_params["pdd"]["exported"]
    assert (exported["num_blocks"], exported["complete"]) == (10, True)
    got = [bytes(shell.arena.view(slot)) for slot in tail]
    assert got == [bytes(shell.arena.view(slot)) for slot in range(6, 10)]
    assert all(any(block) for block in got)
    wait_idle(loop, p)


def test_a_whole_block_prompt_leaves_its_last_token_to_compute(loop, engines, shell):
    p, d = engines
    prompt = prompt_of(4, 256)  # exactly 8 blocks
    slots = list(range(52, 60))
    export(loop, shell, p, "p-4", prompt, slots)
    want, _ = run(loop, p, "base-4", prompt, 6)
    got, last = run(loop, d, "d-4", prompt, 6, wrap(load=LoadParams(slots=slots)))
    assert got == want
    assert last.num_cached_tokens == 255
    assert last.kv_transfer_params["pdd"]["loaded"]["num_tokens"] == 255


def test_more_slots_than_prompt_blocks_is_refused_and_computed(loop, engines, shell):
    p, d = engines
    prompt = prompt_of(5, 200)  # 6 whole blocks + 8 tokens: 7 blocks, the last cut short
    want, _ = run(loop, p, "base-5", prompt, 6)
    fence = shell.fence(2)
    params = wrap(load=LoadParams(slots=list(range(8)), fence=fence))
    got, last = run(loop, d, "d-5", prompt, 6, params)
    assert got == want
    assert last.num_cached_tokens == 0
    assert last.kv_transfer_params["pdd"]["loaded"] == {
        "num_blocks": 0, "first_block": 0, "num_tokens": 0, "ok": False, "seconds": None,
        "error": "8 slots but the prompt (200 tokens) has only 7 blocks of 32 tokens"}  # fmt: skip
    shell.wait_fence(fence)  # a refused request still releases its slots through the fence


def test_abort_after_the_load_frees_every_block_and_posts_the_fence(loop, engines, shell):
    p, d = engines
    prompt = prompt_of(6, 1400)
    slots = list(range(40, 48))  # the first 8 blocks come from P; D computes 1144 tokens
    export(loop, shell, p, "p-6", prompt[:256], slots)
    fence = shell.fence(3)
    params = wrap(load=LoadParams(slots=slots, fence=fence))

    async def abort_mid_prefill() -> list[EngineDelta]:
        spec = SamplingSpec(temperature=0.0, max_tokens=8, ignore_eos=True)
        return [delta async for delta in d.generate("d-6", prompt, spec, params)]

    async def scenario() -> list[EngineDelta]:
        task = asyncio.ensure_future(abort_mid_prefill())
        end = time.monotonic() + 20
        while d.stats().kv_cache_usage == 0.0:  # D holds blocks: the load step ran
            assert time.monotonic() < end and not task.done(), "D never started the request"
            await asyncio.sleep(0.002)
        assert await d.abort("d-6")
        return await task

    deltas = loop.run_until_complete(scenario())
    assert deltas[-1].finish_reason == "abort"
    assert sum(len(x.token_ids) for x in deltas) == 0  # aborted while D was still prefilling
    shell.wait_fence(fence)
    wait_idle(loop, d)
    # The blocks the aborted request loaded (now in D's prefix cache) are sound.
    want, _ = run(loop, p, "base-6", prompt, 8)
    got, _ = run(loop, d, "d-6b", prompt, 8, wrap(load=LoadParams(slots=slots)))
    assert got == want
    wait_idle(loop, d)


def test_a_load_cancelled_while_vllm_adds_it_still_posts_its_fence(loop, engines, shell):
    """The unposted-fence bug (docs/notes/engine.md). The worker shell's ``stream_loading``
    (pdd.worker.kv_run) with real ``Fences``: a KV-load request cancelled before its first
    delta, at each of its first await points (one ``sleep(0)`` in: vLLM's AsyncLLM is still
    processing the prompt on its renderer thread, the request is nowhere yet), must still
    reach the engine core, so that the connector posts its fence and the shell gets its slots
    back. Before the fix a cancel landing inside vLLM's add left the core without the request:
    the fence was never posted and the slots stayed quarantined (the worker not ready) for
    good."""
    p, d = engines
    prompt = prompt_of(7, 300)  # 9 whole blocks + a 12-token tail
    slots = list(range(48, 57))
    export(loop, shell, p, "p-7", prompt, slots)
    for index in range(shell.fences.size):  # a fresh board, as a worker starts with: every
        shell.fences.post(index, 0)  # fence of the earlier tests was read back, none is due
    fences = Fences(shell.fences, timeout_s=5.0)
    spec = SamplingSpec(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def cancel_after(steps: int) -> tuple[int, bool]:
        """Cancel a load request after ``steps`` loop turns: (deltas seen, released)."""
        seen, released = [], asyncio.Event()
        call = GenerateCall(request_id=f"d-7-{steps}", prompt=prompt, sampling=spec)

        async def consume() -> None:
            stream = stream_loading(d, fences, call, slots, BLOCK, released.set)
            async with aclosing(stream):
                async for kv_delta in stream:
                    seen.append(kv_delta)

        task = asyncio.ensure_future(consume())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(TimeoutError):  # a deadline on a wait, not a timing claim
            await asyncio.wait_for(released.wait(), 20)
        return len(seen), released.is_set()

    async def scenario() -> dict[int, tuple[int, bool, int, str | None]]:
        fences.start()
        try:
            out = {}
            for steps in (1, 2, 3, 5, 8):
                n, released = await cancel_after(steps)
                out[steps] = (n, released, fences.outstanding, fences.stall_reason())
            return out
        finally:
            await fences.stop()

    got = loop.run_until_complete(scenario())
    assert got[1][0] == 0  # one loop turn in, the request had no delta yet (inside the add)
    assert {s: r[1:] for s, r in got.items()} == {s: (True, 0, None) for s in got}, got
    wait_idle(loop, d)
    # The slots' blocks are intact: a load of them still decodes like P.
    want, _ = run(loop, p, "base-7", prompt, 8)
    got_tokens, _ = run(loop, d, "d-7b", prompt, 8, wrap(load=LoadParams(slots=slots)))
    assert got_tokens == want
    wait_idle(loop, d)
