"""Typed values that cross the engine boundary. No vLLM, no torch: cheap to import.

The worker, the roles and the connector speak these; only ``pdd.engine.engine`` converts them to
and from vLLM's own classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pdd.errors import InvalidRequestError
from pdd.protocol import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY

KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]
FinishReason = Literal["stop", "length", "abort"]


# What a structured-output constraint is written in (``ConstraintSpec.kind``).
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call")


@dataclass(frozen=True)
class ConstraintSpec:
    """A structured-output constraint and where it resumes (``pdd.engine.constraint``).

    ``spec``: a JSON schema (JSON text), a regex, a JSON list of choices, an EBNF or Lark
    grammar, "" for ``json_object``; for ``tool_call`` a JSON list of ``{"prefix", "schema",
    "suffix"}`` (one alternative per tool: literal text, the arguments' JSON schema, literal
    text), the continuation of a forced tool-call opening. ``resume``: the tokens already
    emitted under the constraint (the client's text so far; the request's prompt ends with
    them). ``param``: the request field it came from, named in a 400.
    """

    kind: str
    spec: str
    resume: tuple[int, ...] = ()
    param: str = "response_format"


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample one request. Validated on construction (InvalidRequestError on bad input).

    ``logprobs``: None for none, 0 for the sampled token only, k for k alternatives too.
    ``prompt_logprobs``: the same for every prompt token after the first (vLLM computes the
    whole prompt then: no prefix-cache hit).
    ``max_tokens``: None means up to the end of the context.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    constraint: ConstraintSpec | None = None
    prior_output_tokens: int = 0  # the prompt's last N tokens are earlier tiers' output
    min_p: float = 0.0  # 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # (): every token
    prompt_logprobs: int | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()  # token ids of each word (pdd.engine.bad_words)

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or positive"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.prior_output_tokens >= 0, "prior_output_tokens", "must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must be <= max_tokens",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (
                0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
                "repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}]",
            ),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (
                all(t >= 0 and abs(b) <= MAX_LOGIT_BIAS for t, b in self.logit_bias),
                "logit_bias",
                f"must map token ids to a bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
            (all(t >= 0 for t in self.allowed_token_ids), "allowed_token_ids", "must be >= 0"),
            (
                all(w and all(t >= 0 for t in w) for w in self.bad_words),
                "bad_words",
                "must be non-empty token id sequences",
            ),
        ]
        for ok, param, msg in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {msg}", param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and, when asked for, the top-k alternatives (best first). ``rank``:
    its rank in that step's distribution (1: the most likely; 0: unknown)."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    rank: int = 0


@dataclass(frozen=True)
class EngineDelta:
    """What one engine step added to one request (RequestOutputKind.DELTA).

    ``num_prompt_tokens`` and ``num_cached_tokens`` describe the prompt and repeat on every
    delta. ``stop_token_id`` is the token that ended the request when ``finish_reason`` is
    "stop" (EOS or one of ``stop_token_ids``; it is the last of ``token_ids``), else None.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: FinishReason | None
    stop_token_id: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.. (the first delta)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine. Counters (``*_tokens``) are totals since start."""

    running: int
    waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, as of the last engine step
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which were found
    generated_tokens: int
    max_model_len: int
    block_size: int = 0
    max_num_seqs: int = 0
    kv_block_bytes: int = 0  # one block's K and V across all layers (0 before start)
    prefill_tokens_per_s: float = 0.0  # measured at start, kept live (Engine; 0: not measured)
    prefill_fixed_s: float = 0.0  # a prefill's cost beyond its tokens (one step, one token)


@dataclass(frozen=True)
class PrefillRate:
    """How fast this engine computes a prompt here: ``fixed_s + tokens / tokens_per_s``."""

    tokens_per_s: float
    fixed_s: float


@dataclass(frozen=True)
class KvConnectorSpec:
    """Which KV connector vLLM loads and its settings (becomes vLLM's KVTransferConfig)."""

    role: KvRole
    extra_config: dict[str, Any] = field(default_factory=dict)
    module_path: str = "pdd.engine.connector"
    name: str = "PddConnector"
