"""The vLLM wrapper against a real engine on the default model (one engine for the module)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from pdd.config import EngineConfig, ModelConfig
from pdd.engine import heap
from pdd.engine.model import prepare_model
from pdd.engine.types import EngineDelta, SamplingSpec
from pdd.errors import ContextLengthError, InvalidRequestError

pytestmark = pytest.mark.slow

PARIS_PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
PARIS = 7042  # " Paris"
PERIOD = 30  # "."
EOS = 2  # <|im_end|>
GREEDY = SamplingSpec(temperature=0, max_tokens=8)
MAX_MODEL_LEN = 1024
BLOCK = 32
CHUNK = 256


def vllm_children() -> list[psutil.Process]:
    """Engine processes below this one (multiprocessing's resource tracker does not count)."""
    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]


class Harness:
    """One event loop and one started Engine, shared by the module's tests."""

    def __init__(self) -> None:
        from pdd.engine.engine import Engine

        self.loop = asyncio.new_event_loop()
        cfg = EngineConfig(
            max_model_len=MAX_MODEL_LEN,
            kv_cache_space_gib=0.25,
            block_size=BLOCK,
            max_num_batched_tokens=CHUNK,  # prompts longer than this are prefilled in chunks
        )
        self.engine = Engine(ModelConfig(), cfg)

    def run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout=120))

    async def collect(self, rid: str, prompt: list[int], sampling: SamplingSpec):
        async with contextlib.aclosing(self.engine.generate(rid, prompt, sampling)) as stream:
            return [d async for d in stream]


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    prepare_model(ModelConfig())
    harness = Harness()
    harness.run(harness.engine.start())
    try:
        yield harness
    finally:
        harness.run(harness.engine.stop())
        harness.loop.close()


def tokens(deltas: list[EngineDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_greedy_capital_of_france_is_paris(h: Harness) -> None:
    deltas = h.run(h.collect("paris", PARIS_PROMPT, SamplingSpec(temperature=0, max_tokens=2)))
    assert tokens(deltas) == [PARIS, PERIOD]
    assert deltas[0].num_prompt_tokens == 5
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].stop_token_id is None
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_token_id_prompts_are_deterministic_under_greedy(h: Harness) -> None:
    prompt = [17, 4000, 123, 9999, 42, 300, 7, 49151]  # ids, not text the tokenizer would make
    spec = SamplingSpec(temperature=0, max_tokens=8, ignore_eos=True)
    first = tokens(h.run(h.collect("ids-1", prompt, spec)))
    second = tokens(h.run(h.collect("ids-2", prompt, spec)))
    assert len(first) == 8
    assert first == second


def test_deltas_stream_incrementally(h: Harness) -> None:
    spec = SamplingSpec(temperature=0, max_tokens=12, ignore_eos=True)
    deltas = h.run(h.collect("stream", PARIS_PROMPT, spec))
    assert len(tokens(deltas)) == 12
    assert len(deltas) >= 2  # one per engine step unless the consumer fell behind
    assert all(len(d.token_ids) >= 1 for d in deltas)
    assert deltas[-1].finish_reason == "length"


def test_eos_stops_and_ignore_eos_runs_to_max_tokens(h: Harness) -> None:
    stopped = h.run(h.collect("eos", PARIS_PROMPT, SamplingSpec(temperature=0, max_tokens=200)))
    assert stopped[-1].finish_reason == "stop"
    assert stopped[-1].stop_token_id == EOS
    assert tokens(stopped)[-1] == EOS
    n = len(tokens(stopped))
    spec = SamplingSpec(temperature=0, max_tokens=n + 3, ignore_eos=True)
    ignored = h.run(h.collect("no-eos", PARIS_PROMPT, spec))
    assert len(tokens(ignored)) == n + 3
    assert tokens(ignored)[:n] == tokens(stopped)
    assert ignored[-1].finish_reason == "length"


def test_stop_token_ids(h: Harness) -> None:
    spec = SamplingSpec(temperature=0, max_tokens=8, stop_token_ids=(PERIOD,))
    deltas = h.run(h.collect("stop-ids", PARIS_PROMPT, spec))
    assert tokens(deltas) == [PARIS, PERIOD]
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].stop_token_id == PERIOD


def test_logit_bias_allowed_token_ids_and_min_p_steer_sampling(h: Harness) -> None:
    """A -100 bias on greedy's answer makes the engine pick another token; a +100 bias on a
    token makes it the answer; allowed_token_ids keeps every sampled token in the set; min_p
    1.0 keeps only the most likely token, so it samples greedy's answer at temperature 1."""
    greedy = SamplingSpec(temperature=0, max_tokens=1)
    banned = h.run(
        h.collect("bias-ban", PARIS_PROMPT, replace(greedy, logit_bias=((PARIS, -100),)))
    )
    assert tokens(banned) != [PARIS]
    forced = h.run(h.collect("bias-up", PARIS_PROMPT, replace(greedy, logit_bias=((42, 100),))))
    assert tokens(forced) == [42]
    allowed = (PERIOD, 42, 1000)
    spec = SamplingSpec(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                        allowed_token_ids=allowed)  # fmt: skip
    assert set(tokens(h.run(h.collect("allowed", PARIS_PROMPT, spec)))) <= set(allowed)
    spec = SamplingSpec(temperature=1.0, seed=5, max_tokens=1, min_p=1.0)
    assert tokens(h.run(h.collect("min-p", PARIS_PROMPT, spec))) == [PARIS]


def test_bad_words_ban_a_words_last_token_after_its_others_earlier_tiers_included(
    h: Harness,
) -> None:
    """A one-token bad word is never sampled; a two-token word's last token is banned only
    where the output ends with its first, and the prompt's last prior_output_tokens count as
    output (an earlier tier emitted them), as one engine that emitted them would ban it."""
    greedy = SamplingSpec(temperature=0, max_tokens=1)
    assert tokens(h.run(h.collect("bw-none", PARIS_PROMPT, greedy))) == [PARIS]
    one = replace(greedy, bad_words=((PARIS,),))
    assert tokens(h.run(h.collect("bw-one", PARIS_PROMPT, one))) != [PARIS]
    # "is" + " Paris": the word's first token is the prompt's last
    two = replace(greedy, bad_words=((PARIS_PROMPT[-1], PARIS),))
    assert tokens(h.run(h.collect("bw-prompt", PARIS_PROMPT, two))) == [PARIS]  # prompt, not output
    prior = replace(two, prior_output_tokens=1)  # an earlier tier emitted "is"
    assert tokens(h.run(h.collect("bw-prior", PARIS_PROMPT, prior))) != [PARIS]


def test_logprobs_top_k(h: Harness) -> None:
    spec = SamplingSpec(temperature=0, max_tokens=3, logprobs=3)
    deltas = h.run(h.collect("logprobs", PARIS_PROMPT, spec))
    lps = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == tokens(deltas)
    for lp in lps:
        assert len(lp.top) == 3
        assert lp.top[0].token_id == lp.token_id  # greedy picks the best
        assert lp.top[0].logprob == lp.logprob
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.logprob <= 0
    none = h.run(h.collect("no-logprobs", PARIS_PROMPT, GREEDY))
    assert all(d.logprobs is None for d in none)


def test_prompt_logprobs_cover_the_prompt_even_when_its_prefix_is_cached(h: Harness) -> None:
    """prompt_logprobs come whole with the first delta, one per prompt token after the first;
    the prompt's next token is the one greedy answers after it (rank 1 there). Asked again,
    the prompt (now in the prefix cache) is computed whole, so the answer is the same."""
    prompt = [*PARIS_PROMPT, PARIS]
    spec = SamplingSpec(temperature=0, max_tokens=1, prompt_logprobs=2)
    runs = [h.run(h.collect(f"prompt-logprobs-{i}", prompt, spec)) for i in range(2)]
    for deltas in runs:
        first = deltas[0].prompt_logprobs
        assert [lp.token_id for lp in first] == prompt[1:]
        assert all(len(lp.top) == 2 and lp.rank >= 1 and lp.logprob <= 0 for lp in first)
        assert first[-1].rank == 1 and first[-1].top[0].token_id == PARIS
        assert all(d.prompt_logprobs == () for d in deltas[1:])
    assert runs[1][0].prompt_logprobs == runs[0][0].prompt_logprobs
    assert runs[1][0].num_cached_tokens == 0  # vLLM reads no prefix cache for them
    none = h.run(h.collect("no-prompt-logprobs", prompt, GREEDY))
    assert none[0].prompt_logprobs == ()


def test_abort_ends_the_stream_and_frees_the_slot(h: Harness) -> None:
    async def scenario() -> list[EngineDelta]:
        spec = SamplingSpec(temperature=0, max_tokens=2000, ignore_eos=True)
        seen: list[EngineDelta] = []
        async with contextlib.aclosing(h.engine.generate("abort-me", PARIS_PROMPT, spec)) as s:
            async for d in s:
                seen.append(d)
                if len(seen) == 3:
                    assert h.engine.stats().running == 1
                    assert await h.engine.abort("abort-me") is True
        return seen

    seen = h.run(scenario())
    assert seen[-1].finish_reason == "abort"
    assert len(tokens(seen)) < 2000
    stats = h.engine.stats()
    assert (stats.running, stats.waiting) == (0, 0)
    assert h.run(h.engine.abort("abort-me")) is False
    assert h.run(h.engine.abort("never-existed")) is False


def test_consumer_leaving_early_aborts_the_request(h: Harness) -> None:
    spec = SamplingSpec(temperature=0, max_tokens=2000, ignore_eos=True)

    async def leave_early() -> None:
        async with contextlib.aclosing(h.engine.generate("leave", PARIS_PROMPT, spec)) as s:
            async for _ in s:
                break

    async def cancelled() -> None:
        async def consume() -> None:
            async for _ in h.engine.generate("cancel", PARIS_PROMPT, spec):
                pass

        task = asyncio.ensure_future(consume())
        while h.engine.stats().running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    h.run(leave_early())
    assert h.engine.stats().running == 0
    h.run(cancelled())
    assert h.engine.stats().running == 0
    # The engine still serves after both.
    assert tokens(h.run(h.collect("after", PARIS_PROMPT, GREEDY)))[0] == PARIS


def test_prefix_cache_hit_on_repeated_prompt(h: Harness) -> None:
    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    spec = SamplingSpec(temperature=0, max_tokens=1)
    before = h.engine.stats()
    cold = h.run(h.collect("cold", prompt, spec))
    warm = h.run(h.collect("warm", prompt, spec))
    after = h.engine.stats()
    assert cold[0].num_cached_tokens == 0
    # Only whole blocks are reused: 300 tokens -> 9 blocks of 32 = 288.
    assert warm[0].num_cached_tokens == 288
    assert tokens(warm) == tokens(cold)
    assert after.prefix_cache_queries - before.prefix_cache_queries == 600
    assert after.prefix_cache_hits - before.prefix_cache_hits == 288


def test_invalid_requests_are_refused(h: Harness) -> None:
    async def first(prompt: list[int], spec: SamplingSpec = GREEDY) -> None:
        async for _ in h.engine.generate("bad", prompt, spec):
            break

    with pytest.raises(InvalidRequestError, match="must not be empty"):
        h.run(first([]))
    with pytest.raises(ContextLengthError):
        h.run(first([100] * MAX_MODEL_LEN))
    with pytest.raises(InvalidRequestError, match="token ids"):
        h.run(first([49152]))
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingSpec(top_p=0)
    assert h.engine.stats().running == 0


def test_stats_count_generated_tokens(h: Harness) -> None:
    before = h.engine.stats().generated_tokens
    h.run(
        h.collect("count", PARIS_PROMPT, SamplingSpec(temperature=0, max_tokens=5, ignore_eos=True))
    )
    assert h.engine.stats().generated_tokens - before == 5
    stats = h.engine.stats()
    assert (stats.max_model_len, stats.block_size, stats.max_num_seqs) == (MAX_MODEL_LEN, BLOCK, 32)
    # SmolLM2 in float32 (the default): 2 (K,V) x 30 layers x 3 KV heads x 64 x 4 bytes
    # = 46,080 B/token.
    assert stats.kv_block_bytes == 46_080 * BLOCK


def test_seeded_sampling_of_a_chunked_prompt_survives(h: Harness) -> None:
    # vLLM 0.32's CPU model runner crashed the engine core here ("CPU Generator does not use
    # offset") until pdd's vLLM plugin (pdd.engine.vllm_plugin) made the rewind a no-op.
    prompt = (PARIS_PROMPT * 120)[: CHUNK * 2 + 10]
    seeded = SamplingSpec(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    run = h.run(h.collect("seeded-chunked", prompt, seeded))
    assert sum(len(d.token_ids) for d in run) == 8
    # Unchunked prompts keep exact seeded reproducibility.
    short = [h.run(h.collect(f"seeded-short-{i}", PARIS_PROMPT, seeded)) for i in range(2)]
    tokens = [[t for d in r for t in d.token_ids] for r in short]
    assert len(tokens[0]) == 8 and tokens[0] == tokens[1]
    greedy = h.run(h.collect("after-seeded", PARIS_PROMPT, GREEDY))
    assert greedy[0].token_ids[0] == PARIS  # the engine still serves


def test_a_constraint_is_enforced_and_resumes_from_emitted_tokens(h: Harness) -> None:
    """The pdd constraint processor on a real engine: a regex holds, and a request whose
    prompt ends with tokens already emitted under the constraint continues the grammar from
    them (``resume``) instead of starting it again. Two constrained requests and a free one
    run in one batch."""
    from transformers import AutoTokenizer

    from pdd.engine.types import ConstraintSpec

    tok = AutoTokenizer.from_pretrained(str(ModelConfig().resolved_path()))
    prompt = tok.encode("Write a code: ")
    regex = "abc-[0-9]{3}"
    spec = SamplingSpec(temperature=0, max_tokens=16, constraint=ConstraintSpec("regex", regex))
    emitted = tok.encode("abc-", add_special_tokens=False)
    resumed = SamplingSpec(
        temperature=0, max_tokens=16,
        constraint=ConstraintSpec("regex", regex, resume=tuple(emitted), param="guided_regex"),
    )  # fmt: skip

    async def batch():
        return await asyncio.gather(
            h.collect("c-whole", prompt, spec),
            h.collect("c-resumed", prompt + emitted, resumed),
            h.collect("c-free", PARIS_PROMPT, SamplingSpec(temperature=0, max_tokens=2)),
        )

    whole, rest, free = (tokens(d) for d in h.run(batch()))
    assert whole[-1] == EOS and rest[-1] == EOS
    text = tok.decode(whole[:-1])
    assert re.fullmatch(regex, text), text
    cont = tok.decode(rest[:-1])
    assert re.fullmatch("[0-9]{3}", cont), cont  # the grammar went on after "abc-"
    assert free == [PARIS, PERIOD]  # the unconstrained row is untouched


def test_penalties_continue_across_a_tier_change(h: Harness) -> None:
    """Greedy with presence and frequency penalties: a second request that continues from
    the first k emitted tokens (now prompt tokens, ``prior_output_tokens`` = k) decodes what
    one request of the whole answer does; without the count the penalties restart and the
    text changes (pdd.engine.penalties)."""
    pen = dict(temperature=0, presence_penalty=0.8, frequency_penalty=1.2, ignore_eos=True)
    prompt = PARIS_PROMPT + [30, 504, 3575, 282]  # ". The capital of": the answer repeats
    whole = tokens(h.run(h.collect("pen-whole", prompt, SamplingSpec(max_tokens=24, **pen))))
    assert len(whole) == 24
    k = 6
    head = tokens(h.run(h.collect("pen-head", prompt, SamplingSpec(max_tokens=k, **pen))))
    assert head == whole[:k]
    resumed = SamplingSpec(max_tokens=24 - k, prior_output_tokens=k, **pen)
    tail = tokens(h.run(h.collect("pen-tail", prompt + head, resumed)))
    assert tail == whole[k:]
    forgot = tokens(h.run(h.collect("pen-forgot", prompt + head,
                                    SamplingSpec(max_tokens=24 - k, **pen))))  # fmt: skip
    assert forgot != whole[k:]  # what vLLM alone does at a tier change


def test_a_session_keeps_its_kv_between_turns_and_continues_as_one_request(h: Harness) -> None:
    """MD's Catch-Up on one engine (``Engine.session``): turn 1 computes prompt + the first
    emitted tokens (its sampled token is dropped), turn 2 the next few, the last turn one
    more and decodes the rest, the penalties counting every emitted token: the same tokens as
    one request of the whole answer. Between turns the request stays in the engine (not
    counted as running or waiting: no load) and later turns look nothing up in the prefix
    cache (they compute only their own tokens); ``close`` ends it, and ``abort`` ends one
    between turns."""
    pen = dict(temperature=0, presence_penalty=0.8, frequency_penalty=1.2, ignore_eos=True)
    prompt = [(i * 7919) % 40000 + 100 for i in range(75)] + PARIS_PROMPT  # a partial block
    whole = tokens(h.run(h.collect("sess-whole", prompt, SamplingSpec(max_tokens=24, **pen))))

    async def turns(session, *chunks):
        out = []
        for toks, spec in chunks:
            async with contextlib.aclosing(session.turn(toks, spec)) as stream:
                out.append(tokens([d async for d in stream]))
        return out

    def warm(k: int) -> SamplingSpec:
        return SamplingSpec(max_tokens=1, prior_output_tokens=k, **pen)

    session = h.engine.session("sess")
    h.run(turns(session, (prompt + whole[:5], warm(5)), (whole[5:9], warm(9))))
    between, queries = h.engine.stats(), h.engine.stats().prefix_cache_queries
    last = SamplingSpec(max_tokens=14, prior_output_tokens=10, **pen)
    (tail,) = h.run(turns(session, (whole[9:10], last)))
    assert tail == whole[10:]
    assert (between.running, between.waiting) == (0, 0)  # it holds KV, but is no load
    assert h.engine.stats().prefix_cache_queries == queries  # the last turn looked nothing up
    assert session.tokens == prompt + whole[:10]
    h.run(session.close())
    assert h.engine.stats().running == 0

    dropped = h.engine.session("sess-dropped")
    h.run(turns(dropped, (prompt, warm(0))))
    h.run(dropped.abort())
    assert h.engine.stats().running == 0
    with pytest.raises(InvalidRequestError, match="has ended"):
        h.run(turns(dropped, (whole[:1], last)))
    assert tokens(h.run(h.collect("sess-after", PARIS_PROMPT, GREEDY)))[0] == PARIS


def test_a_bad_constraint_is_refused_naming_the_parameter(h: Harness) -> None:
    from pdd.engine.types import ConstraintSpec

    bad = SamplingSpec(constraint=ConstraintSpec("json_schema", "{", param="guided_json"))
    with pytest.raises(InvalidRequestError) as err:
        h.run(h.collect("c-bad", PARIS_PROMPT, bad))
    assert err.value.param == "guided_json"


def test_engine_core_bounds_its_heap(h: Harness) -> None:
    """What keeps a prefill engine's memory flat (pdd.engine.heap) reaches the engine core: the
    oneDNN cache bound in the environment it inherits, and its heap-trimming thread."""
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    (core,) = vllm_children()
    names = {t.name for t in Path(f"/proc/{core.pid}/task").iterdir()}
    threads = {(Path(f"/proc/{core.pid}/task") / n / "comm").read_text().strip() for n in names}
    assert heap.THREAD_NAME in threads


def test_a_small_chip_profile_of_this_engine(h: Harness) -> None:
    """`pdd profile` on the module's engine, tiny (two lengths, batches 1 and 2, 8 tokens):
    every sample is a real timing and the fitted profile is one the planner reads."""
    from pdd.plan.fit import fit_profile
    from pdd.profiler import Plan, Progress, measure

    plan = Plan(lengths=(64, 192), batches=(1, 2), extend_tokens=(1, 24), decode_tokens=8,
                repeats=1)  # fmt: skip
    measured = h.run(measure(h.engine, plan, "cpu", 0, Progress(plan.steps)))
    assert len(measured.prefill) == 6 and len(measured.decode) == 4 and len(measured.extend) == 2
    assert all(s.seconds > 0 for s in measured.prefill) and all(
        d.step_s > 0 for d in measured.decode
    )
    assert measured.kv_bytes_per_token == h.engine.kv_block_bytes // BLOCK  # all layers, K and V
    assert measured.block_size == BLOCK and measured.chunk_tokens == CHUNK
    assert (
        measured.kv_capacity_tokens > 0
        and measured.max_batch == h.engine.engine_config.max_num_seqs
    )
    profile = fit_profile(measured, 0.1)
    assert profile.prefill_s(192, 0) > 0 and profile.decode_step_s(2, 400) > 0
    assert profile.kv_bytes_per_token * BLOCK == h.engine.kv_block_bytes
    assert h.engine.stats().running == 0  # every timed request ended


def test_prefill_is_measured_and_kept_live_by_requests_that_compute_enough(h: Harness) -> None:
    """measure_prefill (what an MD reports for router.pdd.md_recompute): a positive rate and a
    non-negative fixed cost, and nothing of it counted as a sample. Then the rate is live: a
    cold request computing at least 256 prompt tokens pulls a deliberately wrong rate toward
    the engine's real one; a short one, or one served from the prefix cache, does not."""
    from pdd.engine.types import PrefillRate

    measured = h.run(h.engine.measure_prefill(tokens=256))
    assert measured.tokens_per_s > 0 and measured.fixed_s >= 0, measured
    spec = SamplingSpec(temperature=0, max_tokens=1)
    cold = [(i * 104729) % 40000 + 100 for i in range(300)]
    try:
        h.engine.prefill_rate = PrefillRate(1.0, 0.0)  # 1 token/s: far too slow
        h.run(h.collect("short", [t + 1 for t in cold[:100]], spec))
        assert h.engine.prefill_rate == PrefillRate(1.0, 0.0)  # 100 tokens: no sample
        h.run(h.collect("long", cold, spec))
        rate = h.engine.prefill_rate
        assert rate is not None and rate.tokens_per_s > 1.0, rate  # pulled up, whatever the CPU
        assert h.engine.stats().prefill_tokens_per_s == rate.tokens_per_s
        h.run(h.collect("again", cold, spec))  # 288 of 300 from the prefix cache
        assert h.engine.prefill_rate == rate
    finally:
        h.engine.prefill_rate = None


def test_stop_leaves_no_engine_process(h: Harness) -> None:
    """Runs last: it stops the module's engine."""
    assert len(vllm_children()) == 1
    h.run(h.engine.stop())
    assert vllm_children() == []
    assert not h.engine.ready
