"""Typed messages that flow through the router.

    HTTP body --validation--> GenerationRequest --pipeline--> TokenEvent* --output--> OutputDelta*

``GenerationRequest`` is what a pipeline driver needs to run a request on workers (token IDs
and sampling settings only: workers never see text). ``TokenEvent`` is one step of worker
output. ``OutputDelta`` is what the API layer formats into OpenAI chunks and responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdd.protocol import HandoffMode, Pipeline


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Sampling settings a worker applies. Validated; every field has its effective value."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: sampled token only; k: plus top-k alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    prior_output_tokens: int = 0  # the prompt's last N tokens were emitted by earlier tiers
    min_p: float = 0.0  # 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by id
    allowed_token_ids: tuple[int, ...] = ()  # (): every token
    # the prompt's tokens after the first, as ``logprobs``; only P (or the colocated worker)
    # computes them (``EmittedStream.continuation`` asks no other tier)
    prompt_logprobs: int | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()  # each word's token ids, as vLLM tokenizes it


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How the router turns tokens into text (workers never see these). ``echo``: the
    prompt's text, put before the completion (completions' ``echo``); ``echo_only``: the
    completion itself is not shown (``echo`` with ``max_tokens`` 0: one token is generated, as
    vLLM does, and dropped)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    echo: str | None = None
    echo_only: bool = False


@dataclass(frozen=True, slots=True)
class Constraint:
    """A structured-output constraint (``response_format``, ``structured_outputs``, ...).

    ``kind``: json_schema | json_object | regex | choice | grammar; ``spec``: the schema as
    JSON text, the regex, the choices as a JSON list, or the EBNF ("" for json_object).
    ``resume``: the tokens emitted under it so far; every tier's Generate carries them
    (``EmittedStream.continuation``) so the worker resumes the grammar where the client is.
    ``param``: the request field it came from (a worker's 400 names it).
    """

    kind: str
    spec: str
    param: str
    resume: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One admitted request, ready to route. ``arrival`` is ``time.monotonic()`` at receipt."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    text: TextOptions
    arrival: float
    pipeline: Pipeline | None = None  # body "pdd": {"pipeline": ...}; None: auto
    handoff: HandoffMode | None = None  # body "pdd": {"handoff": ...}; None: auto
    cache_salt: str = ""  # prefix-cache namespace of the caller's tenant ("": the shared one)
    constraint: Constraint | None = None  # structured output; None: free text
    await_kv_first: bool = False  # "pdd": {"kv_wait": "await_first"}: AwaitKv, then Generate
    one_off: bool = False  # "pdd": {"one_off": true}: its prefix will not be reused
    stream_kv: bool | None = None  # "pdd": {"stream_kv": ...}; None: router.pdd.stream_kv


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Logprob of one token, with the top alternatives when requested; ``rank``: its rank in
    that step's distribution (1: the most likely; 0: unknown)."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    rank: int = 0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New tokens from one worker step. ``finish_reason`` is set on the last event only.

    ``stop_token_id`` is the token that ended generation when the worker stopped on an EOS or
    a ``stop_token_ids`` entry (that token is the last of ``token_ids``), else None.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    stop_token_id: int | None = None
    worker_id: str = ""
    kv_staged_blocks: int = 0  # P with kv_stage: whole prompt blocks staged (last event)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.. (first event, if asked)


@dataclass(frozen=True, slots=True)
class KvIn:
    """Where a Generate's prompt KV comes from: ``transfer`` (RLD, baseline D) or ``drc`` (MD)."""

    source: str
    kv_request_id: str
    wait_s: float


@dataclass(frozen=True, slots=True)
class PromptRef:
    """A Generate's prompt begins with the first ``tokens`` of the prompt its worker got in
    PrepareKv(``kv_request_id``): only the rest is sent (``GenerateRequest.prompt_ref``)."""

    kv_request_id: str
    tokens: int


@dataclass(frozen=True, slots=True)
class SessionRef:
    """MD's Catch-Up: the request continues across Generate calls on one MD
    (``GenerateRequest.session``); with ``keep`` MD holds it open after this call, and
    ``Abort(id)`` ends it."""

    id: str
    keep: bool


@dataclass(frozen=True, slots=True)
class LogprobText:
    """One token's logprob with its text, ready for OpenAI's (and vLLM's) logprob shapes.
    ``logprob`` is None only for an echoed prompt's first token (nothing precedes it)."""

    token: str
    token_bytes: bytes
    logprob: float | None
    text_offset: int  # character offset of the token's text in the response's text
    top: tuple[TopText, ...] = ()
    token_id: int = -1
    rank: int = 0  # in its step's distribution (1: the most likely; 0: unknown)


class TopText(NamedTuple):
    """One top alternative of a ``LogprobText`` (its rank: its place in ``top``, from 1)."""

    token: str
    token_bytes: bytes
    logprob: float
    token_id: int


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class OutputDelta:
    """Text (and its tokens) safe to show the client. The last delta has finish_reason + usage."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[LogprobText, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    pdd: PddSummary | None = None  # on the first and the last delta of a request
    prompt_logprobs: tuple[LogprobText, ...] | None = None  # the first delta, when asked


@dataclass(frozen=True, slots=True)
class PddSummary:
    """The ``pdd`` object of a response: how the request was served (see ``record``)."""

    pipeline: str
    prompt_tokens: int
    md_cached_tokens: int = 0
    wan_kv_bytes: int = 0  # expected on the wire, after P's codec
    wan_kv_raw_bytes: int = 0  # before the codec
    rld_tokens: int = 0
    handoff: str = HandoffMode.NONE.value
    handoff_rounds: int = 0
    md_computed: bool = False  # MD computed the prompt blocks it lacked: no KV crossed for them
    p: str | None = None
    rld: str | None = None
    md: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline, "prompt_tokens": self.prompt_tokens,
            "md_cached_tokens": self.md_cached_tokens, "wan_kv_bytes": self.wan_kv_bytes,
            "wan_kv_raw_bytes": self.wan_kv_raw_bytes,
            "rld_tokens": self.rld_tokens, "handoff": self.handoff,
            "handoff_rounds": self.handoff_rounds, "md_computed": self.md_computed,
            "p": self.p, "rld": self.rld, "md": self.md,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """What the deployment serves: model ids, context length, vocabulary, default sampling."""

    model_names: tuple[str, ...]  # the served name first, then accepted aliases (model path)
    max_model_len: int
    vocab_size: int
    defaults: dict[str, float | int] = field(default_factory=dict)  # generation_config.json
