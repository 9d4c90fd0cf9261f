"""One vLLM engine (``vllm.v1`` AsyncLLM) behind a small, typed, token-ID-only interface.

Owns: the AsyncLLM, its engine-core child process (which dies with this process, however this
process dies: ``pdd.engine.lifeline``), the in-flight request set and the counters behind
``stats()``. Together with the KV connector this is the only module that imports vLLM.

Lifecycle: ``Engine(...)`` (cheap) -> ``await start()`` (prepares the model folder, spawns the
engine core, ~10-20 s on CPU) -> ``generate`` / ``abort`` / ``stats`` -> ``await stop()`` (aborts
in-flight requests, shuts the child down). Text never crosses this boundary: the router owns
tokenization and detokenization, so vLLM runs without a tokenizer (``skip_tokenizer_init``) and
EOS ids come from the model's generation_config.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from pdd.engine.env import configure_process_env, omp_env, update_env

configure_process_env()

from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.engine.protocol import StreamingInput  # noqa: E402
from vllm.exceptions import VLLMClientError  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.outputs import STREAM_FINISHED, RequestOutput  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError  # noqa: E402
from vllm.v1.engine.output_processor import RequestOutputCollector  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

from pdd.config import EngineConfig, ModelConfig  # noqa: E402
from pdd.engine import bad_words, heap, penalties  # noqa: E402
from pdd.engine.constraint import EXTRA_KEY, FQCN, check_spec, to_extra  # noqa: E402
from pdd.engine.lifeline import spawning  # noqa: E402
from pdd.engine.model import prepare_model  # noqa: E402
from pdd.engine.types import (  # noqa: E402
    EngineDelta,
    EngineStats,
    KvConnectorSpec,
    PrefillRate,
    SamplingSpec,
    TokenLogprob,
    TopLogprob,
)
from pdd.errors import (  # noqa: E402
    ContextLengthError,
    InvalidRequestError,
    PddError,
    UnavailableError,
    WorkerError,
)
from pdd.kv_geometry import (  # noqa: E402
    LAYOUT_CPU_PACKED,
    LAYOUT_GPU_PAGED,
    KvGeometry,
    model_fingerprint,
)

log = logging.getLogger(__name__)
GiB = 1 << 30


class _Counters:
    """Totals fed by vLLM's stat-logger hook; read by Engine.stats()."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.generated_tokens = 0


class _StatSink(StatLoggerBase):
    """vLLM calls ``record`` after every engine step in the frontend (our event loop)."""

    def __init__(self, counters: _Counters) -> None:  # noqa: D107 (not vLLM's signature)
        self._c = counters

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        c = self._c
        if scheduler_stats is not None:
            c.running = scheduler_stats.num_running_reqs
            c.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            c.kv_cache_usage = scheduler_stats.kv_cache_usage
            c.prefix_queries += scheduler_stats.prefix_cache_stats.queries
            c.prefix_hits += scheduler_stats.prefix_cache_stats.hits
        if iteration_stats is not None:
            c.generated_tokens += iteration_stats.num_generation_tokens

    def log_engine_initialized(self) -> None:
        pass


SESSION_CLOSE_S = 10.0  # a closing session's final input answered within this, or aborted
PREFILL_SAMPLE_TOKENS = 256  # a request computing fewer is too short to time the rate
PREFILL_EWMA = 0.3
# The step budget of a GPU engine whose KV streams out as it prefills (a P), unless configured:
# a chunk's blocks leave only once its forward ran, so the first chunk is the links' idle time,
# and vLLM's GPU default (8,192 or more) leaves a prompt's first 8K tokens unsent. 2,048:
# vLLM's "small" chunked-prefill budget, where an H100's GEMMs stay efficient (assumed, not
# measured here). CPU engines keep vLLM's default (2,048): on the lab 512 started the WAN
# 5 s sooner on a 3,000-token prompt but the link's CPU then ran beside P's prefill, +20-26%
# on P's TTFT (docs/benchmarks.md, "P's step budget").
STREAM_STEP_TOKENS_GPU = 2048


class Engine:
    """One AsyncLLM. Not thread-safe: use it from the event loop that called ``start``."""

    def __init__(
        self,
        model: ModelConfig,
        engine: EngineConfig,
        kv_connector: KvConnectorSpec | None = None,
        measure_prefill: bool = False,
        streams_kv: bool = False,
    ) -> None:
        """``measure_prefill``: time a short and a long prefill once started
        (``prefill_rate``, reported in ``stats``), then keep it live (``_observe_prefill``).
        ``streams_kv``: its KV leaves chunk by chunk as it prefills (a P): on a GPU without a
        configured ``max_num_batched_tokens`` the step budget is ``STREAM_STEP_TOKENS_GPU``."""
        self.model_config = model
        self.engine_config = engine
        self.kv_connector = kv_connector
        self._llm: AsyncLLM | None = None
        self._counters = _Counters()
        self._inflight: set[str] = set()
        self._resting: set[str] = set()  # sessions between turns (in _inflight, not load)
        self._eos_ids: tuple[int, ...] = ()
        self.vocab_size = 0
        self.kv_block_bytes = 0
        self.kv_capacity_tokens = 0  # device KV in tokens (vLLM's blocks x block size)
        self.kv_geometry: KvGeometry | None = None  # set once the engine is up
        self.startup_s: float | None = None
        self._measure_prefill = measure_prefill
        self._streams_kv = streams_kv
        self.prefill_rate: PrefillRate | None = None

    # --- lifecycle -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._llm is not None and not self._llm.errored

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    async def start(self) -> None:
        """Prepare the model folder and spawn the engine core. Raises ModelError, WorkerError."""
        if self._llm is not None:
            return
        started = time.monotonic()
        path = await asyncio.to_thread(prepare_model, self.model_config)
        args = self._engine_args(path)
        sinks = [lambda _cfg, _idx=0: _StatSink(self._counters)]
        try:
            with self._spawn_env(), spawning():  # the core dies with us (pdd.engine.lifeline)
                # Construction blocks for seconds (spawn + handshake): keep the loop free.
                llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=sinks)
        except Exception as exc:  # vLLM raises bare RuntimeError/ValueError on start failure
            raise WorkerError(f"vLLM engine failed to start for {path}: {exc}") from exc
        self._llm = llm
        self.vocab_size = llm.model_config.get_vocab_size()
        self._eos_ids = _eos_ids(llm)
        blocks = llm.vllm_config.cache_config.num_gpu_blocks or 0  # the core's, via handshake
        self.kv_capacity_tokens = blocks * self.engine_config.block_size
        fingerprint = await asyncio.to_thread(model_fingerprint, path)
        self.kv_geometry = _kv_geometry(llm, fingerprint, self.engine_config.block_size)
        self.kv_block_bytes = self.kv_geometry.block_bytes  # one slot: every layer and head
        self.startup_s = time.monotonic() - started
        log.info("engine ready in %.1f s (model %s)", self.startup_s, path)
        if self._measure_prefill:
            try:
                self.prefill_rate = rate = await self.measure_prefill()
            except PddError as exc:  # the engine serves anyway; the router never recomputes here
                log.warning("prefill not measured (%s): MD will not recompute", exc.message)
            else:
                log.info("prefill measured: %.0f tokens/s + %.0f ms a request",
                         rate.tokens_per_s, rate.fixed_s * 1000)  # fmt: skip

    async def measure_prefill(self, tokens: int = 512) -> PrefillRate:
        """Time this engine's prefill here: a 16-token and a ``tokens``-token prompt of fresh
        ids (never prefix-cached; no KV connector parameters, so nothing is exported), one
        output token each, after one warm-up. The slope is the prefill rate, the rest of the
        short one its fixed cost. What the router weighs a WAN transfer against when MD could
        compute the blocks it lacks itself (``router.pdd.md_recompute``)."""
        small, salt = 16, int(time.monotonic_ns() % 1_000_003)
        tokens = max(small + 1, min(tokens, self.max_model_len - 1))
        spec = SamplingSpec(temperature=0, max_tokens=1, ignore_eos=True)
        span = max(self.vocab_size - 200, 1)

        async def timed(n: int, k: int) -> float:
            ids = [(i * 7919 + (salt + k) * 104729) % span + 100 for i in range(n)]
            started = time.monotonic()
            async for _ in self.generate(f"pdd-measure-prefill-{salt}-{k}", ids, spec):
                pass
            return time.monotonic() - started

        await timed(small, 0)  # the first forward after start pays one-off setup
        short, long = await timed(small, 1), await timed(tokens, 2)
        rate = (tokens - small) / max(long - short, 1e-6)
        return PrefillRate(rate, max(0.0, short - small / rate))

    def _engine_args(self, path: Path) -> AsyncEngineArgs:
        e, m = self.engine_config, self.model_config
        kv_transfer = None
        if self.kv_connector is not None:
            spec = self.kv_connector
            kv_transfer = KVTransferConfig(
                kv_connector=spec.name,
                kv_connector_module_path=spec.module_path,
                kv_role=spec.role,
                kv_connector_extra_config=dict(spec.extra_config),
            )
        on_cpu = current_platform.is_cpu()
        return AsyncEngineArgs(
            model=str(path),
            served_model_name=m.name,
            dtype=e.dtype or m.dtype,
            kv_cache_dtype=e.kv_cache_dtype,
            quantization=e.quantization,
            max_model_len=e.max_model_len,
            block_size=e.block_size,
            enable_prefix_caching=e.enable_prefix_caching,
            max_num_seqs=e.max_num_seqs,
            tensor_parallel_size=e.tensor_parallel_size,
            distributed_executor_backend="mp" if e.tensor_parallel_size > 1 else None,
            max_num_batched_tokens=self.step_tokens(),
            enforce_eager=e.enforce_eager,
            async_scheduling=e.async_scheduling,
            seed=e.seed,
            skip_tokenizer_init=True,
            # CPU: an exact KV budget in bytes (fractional GiB allowed). GPU: a memory fraction.
            kv_cache_memory_bytes=int(e.kv_cache_space_gib * GiB) if on_cpu else None,
            gpu_memory_utilization=e.gpu_memory_utilization,
            kv_transfer_config=kv_transfer,
            disable_log_stats=True,  # our _StatSink still receives every step's stats
            enable_log_requests=False,
            # structured outputs, penalties and bad words that resume across tiers
            # (pdd.engine.constraint, pdd.engine.penalties, pdd.engine.bad_words)
            logits_processors=[FQCN, penalties.FQCN, bad_words.FQCN],
        )

    def step_tokens(self) -> int | None:
        """The step budget given to vLLM: the configured one, or a streaming GPU engine's
        (``STREAM_STEP_TOKENS_GPU``, at least ``max_num_seqs``), or None (vLLM's default)."""
        e = self.engine_config
        if e.max_num_batched_tokens is not None or not self._streams_kv:
            return e.max_num_batched_tokens
        if current_platform.is_cpu():
            return None
        return max(STREAM_STEP_TOKENS_GPU, e.max_num_seqs)

    @contextlib.contextmanager
    def _spawn_env(self) -> Iterator[None]:
        """Environment the engine-core child inherits (CPU only), restored once it is spawned.

        Engines in one process must therefore be started one at a time.
        """
        if not current_platform.is_cpu():
            yield
            return
        # Run the model inside the engine-core child instead of a grandchild worker process
        # (vLLM's default): ready in 8 s instead of 16 s, one process (~0.5 GiB) less.
        multiproc = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        ranks = self.engine_config.tensor_parallel_size > 1  # a worker process per rank
        env: dict[str, str | None] = {
            # Whole GiB only, and it would override kv_cache_memory_bytes: config decides.
            "VLLM_CPU_KVCACHE_SPACE": None,
            "VLLM_ENABLE_V1_MULTIPROCESSING": multiproc,
            **omp_env(self.engine_config.omp_threads_bind, multiproc == "1" or ranks),
            heap.INTERVAL_ENV: str(self.engine_config.malloc_trim_interval_s),
        }
        saved = {key: os.environ.get(key) for key in env}
        update_env(env)
        try:
            yield
        finally:
            update_env(saved)

    async def stop(self) -> None:
        """Abort in-flight requests and shut the engine-core child down. Idempotent."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._inflight and not llm.errored:
            await llm.abort(list(self._inflight))
        self._inflight.clear()
        # Stop reading outputs first: otherwise the reader sees the child exit and logs an
        # EngineDeadError traceback for a planned shutdown.
        if llm.output_handler is not None:
            llm.output_handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await llm.output_handler
        await asyncio.to_thread(llm.shutdown, 10.0)
        log.info("engine stopped")

    # --- requests ------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], sampling: SamplingSpec) -> None:
        """Raise InvalidRequestError/ContextLengthError if this request cannot be served."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids must not be empty", param="prompt")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ContextLengthError(
                f"prompt has {n} tokens; this model's context is {self.max_model_len} tokens "
                "(prompt plus at least one output token)",
                param="prompt",
            )
        if self.vocab_size and not all(0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", param="prompt"
            )
        if self.vocab_size and not all(t < self.vocab_size for t in sampling.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be in [0, {self.vocab_size})", param="stop_token_ids"
            )
        if sampling.constraint is not None:
            check_spec(sampling.constraint, self.vocab_size)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[EngineDelta]:
        """Stream the new tokens of one request, one delta per engine step. ``cache_salt``:
        vLLM's prefix-cache namespace (blocks cached under another salt never hit).

        Closing the iterator early (``aclose``, break + GC, task cancellation) aborts the request
        in the engine. Submission is atomic with respect to cancellation (``_add_whole``): once
        the first ``__anext__`` has begun, either the engine core receives the request (and a
        cancelled caller's abort follows it there, so the core finishes it and its KV
        connector sees ``request_finished``) or this raises InvalidRequestError, and then the
        core never saw the request. Raises InvalidRequestError only that way, before the first
        delta, for bad input; UnavailableError when not started; WorkerError when the engine
        fails.
        """
        llm = self._require_llm()
        self.validate(prompt_token_ids, sampling)
        if request_id in self._inflight:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        params = self._sampling_params(sampling, kv_transfer_params)
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        self._inflight.add(request_id)
        queue: RequestOutputCollector | None = None
        finished, started, first = False, time.monotonic(), True
        try:
            queue = await _add_whole(llm, request_id, prompt, params)
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                if out is not STREAM_FINISHED:
                    delta = _to_delta(out, sampling)
                    if first:
                        first = False
                        self._observe_prefill(delta, time.monotonic() - started)
                    yield delta
        except (EngineDeadError, EngineGenerateError) as exc:
            raise WorkerError(f"engine failed on request {request_id}: {exc}") from exc
        except PddError:  # InvalidRequestError from the add; _to_delta's own check
            raise
        except Exception as exc:  # what vLLM's own generate() reports as EngineGenerateError
            raise WorkerError(f"engine failed on request {request_id}: {exc!r}") from exc
        finally:
            self._inflight.discard(request_id)
            if queue is not None:
                if not finished and self._llm is not None and not self._llm.errored:
                    await self._llm.abort(queue.request_id, internal=True)
                queue.close()

    def session(self, request_id: str, cache_salt: str = "") -> EngineSession:
        """A request the engine keeps open between turns (see EngineSession). Cheap: nothing
        reaches the engine before its first turn."""
        return EngineSession(self, request_id, cache_salt)

    def _observe_prefill(self, delta: EngineDelta, elapsed_s: float) -> None:
        """Keep the measured prefill rate live: a request that computed at least
        ``PREFILL_SAMPLE_TOKENS`` prompt tokens before its first token is a sample (its tokens
        over its time less the fixed part), folded in with an EWMA. Its time includes what the
        engine did meanwhile, so a busy engine reports the rate it computes at now."""
        rate = self.prefill_rate
        computed = delta.num_prompt_tokens - delta.num_cached_tokens
        if rate is None or computed < PREFILL_SAMPLE_TOKENS or elapsed_s <= rate.fixed_s:
            return
        sample = computed / (elapsed_s - rate.fixed_s)
        tokens_per_s = rate.tokens_per_s + PREFILL_EWMA * (sample - rate.tokens_per_s)
        self.prefill_rate = PrefillRate(tokens_per_s, rate.fixed_s)

    async def abort(self, request_id: str) -> bool:
        """Abort one request; its stream ends with finish_reason "abort". False if unknown."""
        if request_id not in self._inflight or self._llm is None:
            return False
        await self._llm.abort(request_id)
        return True

    async def abort_all(self) -> int:
        """Abort every in-flight request (their streams end with "abort"); returns how many."""
        ids = list(self._inflight)
        if ids and self._llm is not None:
            await self._llm.abort(ids)
        return len(ids)

    def stats(self) -> EngineStats:
        """Counts as of the last engine step, corrected by what the frontend knows now.

        vLLM reports scheduler counts only with step outputs, so after an abort of the last
        request no fresh count arrives; the in-flight set is exact and bounds both numbers.
        A session between turns (EngineSession) holds KV but is neither: not counted.
        """
        c = self._counters
        resting = len(self._resting)  # vLLM counts a session between turns as waiting
        inflight = len(self._inflight) - resting
        waiting = max(0, min(c.waiting - resting, inflight))
        return EngineStats(
            running=inflight - waiting,
            waiting=waiting,
            kv_cache_usage=c.kv_cache_usage,
            prefix_cache_queries=c.prefix_queries,
            prefix_cache_hits=c.prefix_hits,
            generated_tokens=c.generated_tokens,
            max_model_len=self.max_model_len,
            block_size=self.engine_config.block_size,
            max_num_seqs=self.engine_config.max_num_seqs,
            kv_block_bytes=self.kv_block_bytes,
            prefill_tokens_per_s=self.prefill_rate.tokens_per_s if self.prefill_rate else 0.0,
            prefill_fixed_s=self.prefill_rate.fixed_s if self.prefill_rate else 0.0,
        )

    def _require_llm(self) -> AsyncLLM:
        if self._llm is None:
            raise UnavailableError("engine is not running")
        if self._llm.errored:
            raise WorkerError(f"engine is dead: {self._llm.dead_error}")
        return self._llm

    def _sampling_params(
        self, s: SamplingSpec, kv_transfer_params: dict[str, Any] | None
    ) -> SamplingParams:
        stop_ids = list(s.stop_token_ids)
        if not s.ignore_eos:  # no tokenizer in the engine: EOS is a stop token id
            stop_ids += [t for t in self._eos_ids if t not in stop_ids]
        extra: dict[str, Any] = {}
        if kv_transfer_params:
            extra["kv_transfer_params"] = kv_transfer_params
        if s.constraint is not None:
            extra[EXTRA_KEY] = to_extra(s.constraint)
        prior = penalties.prior_extra(
            s.prior_output_tokens, s.presence_penalty, s.frequency_penalty
        )
        if prior is not None:  # penalties count what earlier tiers emitted (engine.penalties)
            extra[penalties.EXTRA_KEY] = prior
        banned = bad_words.extra(s.bad_words, s.prior_output_tokens)
        if banned is not None:  # so do bad words (engine.bad_words)
            extra[bad_words.EXTRA_KEY] = banned
        try:
            return SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else 0,
                max_tokens=s.max_tokens,
                stop_token_ids=stop_ids,
                seed=s.seed,
                logprobs=s.logprobs,
                prompt_logprobs=s.prompt_logprobs,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                repetition_penalty=s.repetition_penalty,
                ignore_eos=s.ignore_eos,
                min_tokens=s.min_tokens,
                min_p=s.min_p,
                logit_bias=dict(s.logit_bias) or None,
                allowed_token_ids=list(s.allowed_token_ids) or None,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
                extra_args=extra or None,
            )
        except (VLLMClientError, ValueError) as exc:
            raise InvalidRequestError(str(exc)) from exc


class EngineSession:
    """One request whose KV the engine keeps between turns (vLLM's streaming-input session).

    ``turn(tokens, sampling)`` appends ``tokens`` to the request's context, computes them
    and streams what it samples, ending with the turn's finish reason; the request then waits
    for the next turn with its KV blocks held (nothing is recomputed, the last partly filled
    block included). vLLM's rule for what a turn keeps: the tokens it computed; the last token
    it sampled was never computed and is dropped (a turn of ``max_tokens=1`` leaves exactly
    its input behind). ``tokens`` is what the engine holds once the current turn ended.
    ``close()`` finishes the request (its KV connector sees ``request_finished``); ``abort()``
    ends it at any point. Only the first turn may carry kv_transfer_params (the connector
    reads them when the request is first scheduled). One turn at a time.
    """

    def __init__(self, engine: Engine, request_id: str, cache_salt: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._salt = cache_salt
        self._inputs: asyncio.Queue[StreamingInput | None] = asyncio.Queue()
        self._queue: RequestOutputCollector | None = None
        self._sent = asyncio.Event()  # vLLM sent the first turn to the engine core
        self.tokens: list[int] = []
        self.ended = False

    @property
    def reached_engine(self) -> bool:
        """vLLM sent the first turn to the engine core: its KV connector will see the request
        (and post a fence its params carry) when it ends."""
        return self._sent.is_set()

    async def _input_stream(self) -> AsyncIterator[StreamingInput]:
        while (item := await self._inputs.get()) is not None:
            yield item
            self._sent.set()  # vLLM asks for the next input once it sent this one

    async def turn(
        self,
        tokens: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[EngineDelta]:
        """Stream this turn's deltas; closing the iterator before its end aborts the session.
        Raises as Engine.generate does."""
        engine, llm = self._engine, self._engine._require_llm()
        if self.ended:
            raise InvalidRequestError(f"session {self.request_id!r} has ended")
        if kv_transfer_params and self._queue is not None:
            raise InvalidRequestError("only a session's first turn may load or export KV")
        whole = self.tokens + list(tokens)
        engine.validate(whole, sampling)
        params = engine._sampling_params(sampling, kv_transfer_params)
        prompt = TokensPrompt(prompt_token_ids=list(tokens))
        if self._queue is None:
            if self._salt:
                prompt["cache_salt"] = self._salt
            if self.request_id in engine._inflight:
                raise InvalidRequestError(f"request id {self.request_id!r} is already running")
            engine._inflight.add(self.request_id)
            try:
                self._queue = await llm.add_request(self.request_id, self._input_stream(), params)
            except (VLLMClientError, ValueError) as exc:
                self.ended = True
                engine._inflight.discard(self.request_id)
                raise InvalidRequestError(str(exc)) from exc
        engine._resting.discard(self.request_id)
        self._inputs.put_nowait(StreamingInput(prompt, params))
        queue, done = self._queue, False
        try:
            while not done:
                out = queue.get_nowait() or await queue.get()
                if out is STREAM_FINISHED:
                    raise WorkerError(f"session {self.request_id} ended by the engine")
                delta = _to_delta(out, sampling)
                done = delta.finish_reason is not None
                yield delta
            if delta.finish_reason == "abort":
                raise WorkerError(f"session {self.request_id} aborted by the engine")
            self.tokens = whole
            engine._resting.add(self.request_id)
        except (EngineDeadError, EngineGenerateError) as exc:
            raise WorkerError(f"engine failed on session {self.request_id}: {exc}") from exc
        except PddError:
            raise
        except Exception as exc:
            raise WorkerError(f"engine failed on session {self.request_id}: {exc!r}") from exc
        finally:
            if not done:
                await self.abort()

    async def close(self) -> None:
        """Finish the request: the engine frees its KV (its prefix cache keeps whole blocks)."""
        if (queue := self._end()) is None:
            return
        self._inputs.put_nowait(None)  # vLLM sends its final (empty) input: the request ends

        async def finished() -> None:
            while (queue.get_nowait() or await queue.get()) is not STREAM_FINISHED:
                pass

        try:
            await asyncio.wait_for(finished(), SESSION_CLOSE_S)
        except Exception as exc:  # noqa: BLE001 (the engine failed or never answered)
            log.warning("session %s did not close cleanly (%r): aborting it", self.request_id, exc)
            await self._abort(queue)

    async def abort(self) -> None:
        """End the session now, in a turn or between turns."""
        if (queue := self._end()) is None:
            return
        if not self._sent.is_set():  # the core must see the request, or its fence never posts
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._sent.wait(), SESSION_CLOSE_S)
        await self._abort(queue)

    def _end(self) -> RequestOutputCollector | None:
        """Mark the session ended (once); its output queue if it ever reached vLLM."""
        if self.ended:
            return None
        self.ended = True
        self._engine._inflight.discard(self.request_id)
        self._engine._resting.discard(self.request_id)
        return self._queue

    async def _abort(self, queue: RequestOutputCollector) -> None:
        queue.close()  # stop feeding inputs, then abort what the engine has
        llm = self._engine._llm
        if llm is not None and not llm.errored:
            await llm.abort(queue.request_id, internal=True)


async def _add_whole(
    llm: AsyncLLM, request_id: str, prompt: TokensPrompt, params: SamplingParams
) -> RequestOutputCollector:
    """``llm.add_request`` run to its end even when the caller is cancelled meanwhile.

    vLLM's own ``AsyncLLM.generate`` adds the request inside its first ``__anext__``, and
    the add awaits (the prompt is processed on the renderer's thread pool): a cancellation
    landing there leaves the request nowhere. generate has no queue yet, so it aborts
    nothing; the engine core never sees the request and never runs its connector's
    ``request_finished``, so the request's KV fence is never posted and its slots stay
    quarantined forever (docs/notes/engine.md, "the unposted fence"). Here the add runs as
    its own task that the caller's cancellation does not reach: it ends with the request
    sent to the engine core (then a cancelled caller aborts it by its internal id over the
    same socket, after the add, and re-raises) or with the add's error, raised before the
    send: a validation error becomes InvalidRequestError, raised even to a cancelled caller
    (it means "the core never saw it", which the caller needs to free a fence at once).
    """
    add = asyncio.ensure_future(llm.add_request(request_id, prompt, params))
    cancelled: asyncio.CancelledError | None = None
    while not add.done():
        try:
            await asyncio.wait([add])  # a cancellation lands here, never in the add
        except asyncio.CancelledError as exc:
            cancelled = exc
    if add.cancelled():  # only a closing event loop cancels the add itself
        raise cancelled or asyncio.CancelledError()
    error = add.exception()
    if error is None:
        queue = add.result()
        if cancelled is None:
            return queue
        if not llm.errored:
            await llm.abort(queue.request_id, internal=True)
        queue.close()
        raise cancelled
    if isinstance(error, (VLLMClientError, ValueError)):  # even if cancelled: the caller
        raise InvalidRequestError(str(error)) from error  # must learn the core never saw it
    raise error


def _kv_geometry(llm: AsyncLLM, fingerprint: str, block_size: int) -> KvGeometry:
    """This engine's KV geometry, from vLLM's own view of the model (pdd.kv_geometry).

    Its slots hold every KV head whatever the tensor-parallel degree (each rank copies its
    own: pdd.engine.connector_worker), so the geometry names them all. The layout is the
    one the connector copies on this platform (pdd.engine.kv_copy): on CPU the block interior
    of vLLM's attention kernels (``_cpu_layout``). On a GPU the connector detects block-first
    or K/V-split per engine inside the engine core, which this process does not see:
    reported as ``LAYOUT_GPU_PAGED`` (two GPU workers compare equal even if their backends
    differ; reporting the detected layout is to do).
    """
    mc, pc, cc = llm.model_config, llm.vllm_config.parallel_config, llm.vllm_config.cache_config
    total_heads = mc.get_total_num_kv_heads()
    cache_dtype = str(cc.cache_dtype)
    kv_dtype = str(mc.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    if kv_dtype.startswith("fp8") and mc.quantization is not None:
        kv_dtype += "_scaled"  # a quantized checkpoint may carry KV scales: never converted
    on_cpu = current_platform.is_cpu()
    head_size = mc.get_head_size()
    layout = _cpu_layout(mc.dtype, block_size, head_size, cache_dtype) if on_cpu else None
    return KvGeometry(
        fingerprint=fingerprint,
        num_layers=mc.get_num_layers(pc),
        total_kv_heads=total_heads,
        kv_head_start=0,
        kv_head_end=total_heads,
        head_dim=head_size,
        block_size=block_size,
        kv_dtype=kv_dtype,
        device=str(current_platform.device_type or "cpu"),
        layout=layout or LAYOUT_GPU_PAGED,
        tensor_parallel_size=pc.tensor_parallel_size,
    )


def _cpu_layout(dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The block interior of vLLM's CPU cache: its attention kernels (the "ISA" vLLM picks
    per dtype, block size and CPU) decide it. The vec kernels' is ``LAYOUT_CPU_PACKED`` (what
    pdd.worker.kv_convert converts); any other is named after its kernels ("cpu_amx": bfloat16
    where AMX tiles exist) and never converted."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
    except (NotImplementedError, RuntimeError):
        isa = "unknown"
    return LAYOUT_CPU_PACKED if isa == "vec" else f"cpu_{isa}"[:16]


def _eos_ids(llm: AsyncLLM) -> tuple[int, ...]:
    """EOS ids from generation_config.json (vLLM loads it even without a tokenizer)."""
    gen = llm.model_config.try_get_generation_config() or {}
    eos = gen.get("eos_token_id", llm.model_config.hf_config.eos_token_id)
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def _to_delta(out: RequestOutput, sampling: SamplingSpec) -> EngineDelta:
    comp = out.outputs[0]
    token_ids = tuple(comp.token_ids)
    finish = comp.finish_reason
    if finish not in (None, "stop", "length", "abort"):
        raise PddError(f"unexpected finish reason {finish!r} from vLLM")
    stop_token_id = token_ids[-1] if finish == "stop" and token_ids else None
    logprobs = None
    if sampling.logprobs is not None and comp.logprobs is not None:
        logprobs = tuple(
            _token_logprob(tid, pos, sampling.logprobs)
            for tid, pos in zip(token_ids, comp.logprobs, strict=True)
        )
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    if sampling.prompt_logprobs is not None and out.prompt_logprobs:
        # whole, on the first output (vLLM's engine core sends no partial prefill); the
        # first prompt token has none (None)
        prompt = out.prompt_token_ids or ()
        prompt_logprobs = tuple(
            _token_logprob(tid, pos, sampling.prompt_logprobs)
            for tid, pos in zip(prompt, out.prompt_logprobs, strict=True)
            if pos is not None
        )
    return EngineDelta(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish,
        stop_token_id=stop_token_id,
        num_prompt_tokens=len(out.prompt_token_ids or ()),
        num_cached_tokens=out.num_cached_tokens or 0,
        kv_transfer_params=out.kv_transfer_params,
        prompt_logprobs=prompt_logprobs,
    )


def _token_logprob(token_id: int, position: Any, k: int) -> TokenLogprob:
    """``position`` maps token id -> Logprob(logprob, rank) for the token + top-k."""
    top = sorted(
        (TopLogprob(tid, lp.logprob) for tid, lp in position.items() if lp.rank and lp.rank <= k),
        key=lambda t: -t.logprob,
    )
    own = position[token_id]
    return TokenLogprob(token_id, own.logprob, tuple(top[:k]), own.rank or 0)
