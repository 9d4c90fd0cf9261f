"""`pdd profile`'s measuring loop over a fake engine (no vLLM): which prompts hit the prefix
cache, what each sample records, and that the samples fit. No assertion on a time."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdd.config import EngineConfig, PddConfig, load_config
from pdd.engine.types import EngineDelta, SamplingSpec
from pdd.plan.fit import fit_profile
from pdd.profiler import Plan, Progress, Served, measure, served_config

BLOCK = 32


class FakeEngine:
    """Whole-block prefix caching per cache salt; sleeps a little per computed token and per
    decode step (more with more requests decoding), one token per delta."""

    def __init__(self) -> None:
        self.engine_config = EngineConfig(max_model_len=1024, block_size=BLOCK, max_num_seqs=8,
                                          max_num_batched_tokens=256)  # fmt: skip
        self.model_config = SimpleNamespace(name="fake", dtype="bfloat16")
        self.vocab_size, self.kv_block_bytes, self.kv_capacity_tokens = 49152, BLOCK * 1000, 4096
        self.cached: dict[str, set[tuple[int, ...]]] = {}
        self.seen: list[tuple[str, int, int]] = []  # (salt, prompt tokens, cached tokens)
        self.active = 0

    def step_tokens(self) -> int | None:
        return self.engine_config.max_num_batched_tokens

    async def generate(self, rid: str, prompt: list[int], spec: SamplingSpec, cache_salt: str = ""):
        held = self.cached.setdefault(cache_salt, set())
        hit = 0
        while hit + BLOCK <= len(prompt) and tuple(prompt[: hit + BLOCK]) in held:
            hit += BLOCK
        held.update(tuple(prompt[:k]) for k in range(BLOCK, len(prompt) + 1, BLOCK))
        self.seen.append((cache_salt, len(prompt), hit))
        await asyncio.sleep(1e-3 + 1e-5 * (len(prompt) - hit))
        self.active += 1
        try:
            for i in range(spec.max_tokens or 1):
                if i:
                    await asyncio.sleep(1e-3 * self.active)
                done = i + 1 == spec.max_tokens
                yield EngineDelta((7,), None, "length" if done else None, None, len(prompt), hit)
        finally:
            self.active -= 1


def test_measure_times_cold_cached_extend_and_decode_samples() -> None:
    engine = FakeEngine()
    plan = Plan(lengths=(64, 200), batches=(1, 3), extend_tokens=(1, 24), decode_tokens=6,
                repeats=2)  # fmt: skip
    m = asyncio.run(measure(engine, plan, "fake", 0, Progress(plan.steps)))
    cold = [p for p in m.prefill if p.cached_tokens == 0]
    assert [p.new_tokens for p in cold] == [64, 200]
    warm = [(p.new_tokens, p.cached_tokens) for p in m.prefill if p.cached_tokens]
    assert warm == [(BLOCK, 64), (BLOCK, 192), (1, 192), (24, 192)]  # whole blocks only
    assert [(e.tokens) for e in m.extend] == [1, 24]
    assert [(d.batch, d.context_tokens) for d in m.decode] == [
        (1, 64 + 3), (1, 200 + 3), (3, 3 * (64 + 3)), (3, 3 * (200 + 3))]  # fmt: skip
    # what the engine saw: cold prompts never hit (a fresh salt each), timed cached ones did
    cold_seen = [s for s in engine.seen if s[0].startswith("cold-")]
    assert len(cold_seen) == 4 and all(hit == 0 for _, _, hit in cold_seen)
    timed_warm = [s for s in engine.seen if s[0] == "extend" and s[2]]
    assert timed_warm and all(hit == 192 for _, _, hit in timed_warm)
    assert m.kv_bytes_per_token == 1000 and m.chunk_tokens == 256 and m.max_batch == 8
    assert m.kv_capacity_tokens == 4096 and engine.active == 0
    profile = fit_profile(m, 0.1)
    assert profile.name == "fake" and profile.memory.kv_capacity_tokens == 4096


def test_each_served_request_is_matched_by_the_engine_at_its_shape() -> None:
    """The served TTFTs (here given) are each paired with the engine's own TTFT of a prompt
    with the same new and cached tokens: a cold one never hits, a warm one hits its prefix."""
    engine = FakeEngine()
    plan = Plan(lengths=(64, 200), batches=(1, 3), extend_tokens=(1, 24), decode_tokens=6,
                repeats=1, served=1, served_tokens=256)  # fmt: skip
    served = (Served(300, 0, 0.5), Served(70, 288, 0.2))
    m = asyncio.run(measure(engine, plan, "fake", 0, Progress(plan.steps), served))
    assert [(o.new_tokens, o.cached_tokens, o.served_s) for o in m.overhead] == [
        (300, 0, 0.5), (70, 288, 0.2)]  # fmt: skip
    timed = [(n, hit) for salt, n, hit in engine.seen if salt.startswith("served-")]
    assert timed[-1] == (288 + 70, 288)  # primed, then timed over its cached prefix
    assert (300, 0) in [(n, hit) for _, n, hit in engine.seen]
    profile = fit_profile(m, 0.1)
    assert profile.serving.request_s > 0  # 0.2 s served against a fake engine's milliseconds


def test_the_served_topology_is_the_profiled_workers_engine_alone() -> None:
    cfg = load_config("configs/local.yaml")
    topo = PddConfig.model_validate(served_config(cfg, cfg.worker("md")))
    assert [(w.role.value, w.id) for w in topo.workers] == [("colocated", "profiled")]
    assert topo.router.mode.value == "colocated" and topo.router.port == 0
    assert topo.engine_for("profiled") == cfg.engine_for("md")
