"""Request bodies -> typed ``GenerationRequest``: every range and combination check.

Pure functions (no I/O). Each failure raises ``InvalidRequestError`` (400) naming the
offending ``param``, ``ContextLengthError`` (400) with the token counts, or
``ModelNotFoundError`` (404). Ranges follow OpenAI and vLLM 0.32's ``SamplingParams``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdd.errors import ContextLengthError, InvalidRequestError, ModelError, ModelNotFoundError
from pdd.protocol import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    HandoffMode,
    Pipeline,
)
from pdd.router.http.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    PddOptions,
)
from pdd.router.types import GenerationRequest, SamplingSpec, ServingLimits, TextOptions

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_CHOICES = 128  # OpenAI's bound on n
INT32_MAX = 2**31 - 1
PIPELINE_OVERRIDES = {"auto": None, "p_md": Pipeline.P_MD, "p_rld_md": Pipeline.P_RLD_MD}
KV_WAIT_OVERRIDES = {"in_generate": False, "await_first": True}  # -> await_kv_first
HANDOFF_OVERRIDES = {
    "auto": None, "one_shot": HandoffMode.ONE_SHOT, "catch_up": HandoffMode.CATCH_UP
}  # fmt: skip


def generation_defaults(folder: str | Path) -> dict[str, float | int]:
    """Sampling defaults from ``generation_config.json`` (as vLLM applies them), if any."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        return {}
    keys = ("temperature", "top_p", "top_k", "repetition_penalty")
    return {k: data[k] for k in keys if isinstance(data.get(k), int | float)}


def check_model(requested: str | None, limits: ServingLimits) -> None:
    if requested is not None and requested not in limits.model_names:
        served = limits.model_names[0]
        raise ModelNotFoundError(
            f"The model `{requested}` does not exist. This server serves `{served}`.",
            param="model",
        )


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them (content always a string)."""
    if not messages:
        raise InvalidRequestError("messages must contain at least one message", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        item: dict[str, Any] = {"role": m.role, "content": _content_text(m.content)}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequestError(
                    f"messages[{i}]: only assistant messages carry tool_calls",
                    param=f"messages[{i}].tool_calls",
                )
            item["tool_calls"] = [
                {"id": c.id or f"call_{i}_{j}", "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for j, c in enumerate(m.tool_calls)
            ]  # fmt: skip
        if m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequestError(
                    f"messages[{i}]: a tool message needs tool_call_id",
                    param=f"messages[{i}].tool_call_id",
                )
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(
                f"content part type {part.type!r} is not supported (text only)", param="messages"
            )
        texts.append(part.text)
    return "\n".join(texts)


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request: text, or token IDs."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidRequestError(
                f"only one prompt per request is supported, got {len(prompt)}", param="prompt"
            )
        prompt = prompt[0]
    if len(prompt) == 0:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    return prompt  # type: ignore[return-value]


def check_token_ids(ids: list[int], limits: ServingLimits, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is out of range [0, {limits.vocab_size})", param=param
        )


def build_chat_request(
    body: ChatCompletionRequest,
    prompt_ids: list[int],
    limits: ServingLimits,
    *,
    request_id: str,
    arrival: float,
) -> GenerationRequest:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = None
    if body.logprobs:
        logprobs = _check_int_range(body.top_logprobs or 0, 0, MAX_LOGPROBS, "top_logprobs")
    max_tokens = (body.max_completion_tokens, "max_completion_tokens")
    if body.max_completion_tokens is None:
        max_tokens = (body.max_tokens, "max_tokens")
    return _build(body, prompt_ids, limits, request_id, arrival, logprobs, max_tokens)


def build_completion_request(
    body: CompletionRequest,
    prompt_ids: list[int],
    limits: ServingLimits,
    *,
    request_id: str,
    arrival: float,
    decode: Callable[[Sequence[int]], str],
) -> GenerationRequest:
    """``decode``: the text of a prompt given as token ids (or truncated), for ``echo``."""
    if body.best_of not in (None, 1):
        raise InvalidRequestError("best_of > 1 is not supported", param="best_of")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    logprobs = None
    if body.logprobs is not None:
        logprobs = _check_int_range(body.logprobs, 0, MAX_LOGPROBS, "logprobs")
    echo_only = body.echo and body.max_tokens == 0  # vLLM: generate one token, show none
    max_tokens = (1 if echo_only else body.max_tokens, "max_tokens")
    req = _build(body, prompt_ids, limits, request_id, arrival, logprobs, max_tokens)
    if not body.echo:
        return req
    # vLLM's echo: the prompt as given (its text), with its logprobs before the completion's
    prompt = completion_prompt(body)
    text = (
        prompt if isinstance(prompt, str) and len(req.prompt_token_ids) == len(prompt_ids) else ""
    )
    s = req.sampling
    prompt_logprobs = s.logprobs if s.prompt_logprobs is None else s.prompt_logprobs
    return replace(
        req, sampling=replace(s, prompt_logprobs=prompt_logprobs),
        text=replace(req.text, echo=text or decode(req.prompt_token_ids), echo_only=echo_only),
    )  # fmt: skip


def _build(
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    limits: ServingLimits,
    request_id: str,
    arrival: float,
    logprobs: int | None,
    max_tokens: tuple[int | None, str],
) -> GenerationRequest:
    _check_stream(body)
    prompt_ids = _truncated(prompt_ids, body.truncate_prompt_tokens, limits)
    prompt_logprobs = None
    if body.prompt_logprobs is not None:
        prompt_logprobs = _check_int_range(body.prompt_logprobs, 0, MAX_LOGPROBS, "prompt_logprobs")
        if body.stream:  # vLLM's rule: they come with the whole response only
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
            )
    sampling = SamplingSpec(
        max_tokens=_max_tokens(max_tokens, len(prompt_ids), limits, _prompt_word(body)),
        temperature=_float(
            body.temperature, limits.defaults.get("temperature", 1.0), 0.0, 2.0, "temperature"
        ),
        top_p=_top_p(body.top_p, limits),
        top_k=_top_k(body.top_k, limits),
        min_tokens=_check_int_range(body.min_tokens, 0, INT64_MAX, "min_tokens"),
        stop_token_ids=tuple(_stop_token_ids(body.stop_token_ids, limits)),
        seed=None
        if body.seed is None
        else _check_int_range(body.seed, INT64_MIN, INT64_MAX, "seed"),
        logprobs=logprobs,
        presence_penalty=_float(body.presence_penalty, 0.0, -2.0, 2.0, "presence_penalty"),
        frequency_penalty=_float(body.frequency_penalty, 0.0, -2.0, 2.0, "frequency_penalty"),
        repetition_penalty=_repetition_penalty(body.repetition_penalty, limits),
        ignore_eos=body.ignore_eos,
        min_p=_float(body.min_p, 0.0, 0.0, 1.0, "min_p"),
        logit_bias=_logit_bias(body.logit_bias, limits),
        allowed_token_ids=_allowed_token_ids(body.allowed_token_ids, limits),
        prompt_logprobs=prompt_logprobs,
    )
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({sampling.min_tokens}) must be at most max_tokens "
            f"({sampling.max_tokens})",
            param="min_tokens",
        )
    text = TextOptions(
        stop=_stops(body.stop),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
    )
    pipeline, handoff, await_kv_first = pdd_overrides(body.pdd)
    return GenerationRequest(
        request_id, tuple(prompt_ids), sampling, text, arrival, pipeline, handoff,
        await_kv_first=await_kv_first, one_off=bool(body.pdd and body.pdd.one_off),
        stream_kv=body.pdd.stream_kv if body.pdd else None,
    )  # fmt: skip


def choice_requests(req: GenerationRequest, n: int, admits: int) -> list[GenerationRequest]:
    """The request of each of ``n`` choices (``n`` checked by the build): ``req`` itself, or,
    as vLLM's parallel sampling, ``n`` requests ``<id>-<i>`` whose seed, when given, is
    ``seed + i``. ``admits``: how many requests the router admits at once; more choices could
    never be served together (400)."""
    if n == 1:
        return [req]
    if n > admits:
        raise InvalidRequestError(
            f"n={n} is more choices than this router admits at once "
            f"(router.max_queued_requests {admits})", param="n",
        )  # fmt: skip
    seed = req.sampling.seed
    if seed is not None and seed + n - 1 > INT64_MAX:
        raise InvalidRequestError(f"seed + n - 1 must be at most {INT64_MAX}", param="seed")
    return [
        replace(
            req,
            request_id=f"{req.request_id}-{i}",
            sampling=replace(req.sampling, seed=None if seed is None else seed + i),
        )  # fmt: skip
        for i in range(n)
    ]


def pdd_overrides(opts: PddOptions | None) -> tuple[Pipeline | None, HandoffMode | None, bool]:
    """The body's ``"pdd"`` overrides (None: auto; ``await_kv_first``: ``kv_wait``). 400 for
    values pdd does not know."""
    if opts is None:
        return None, None, False
    return (
        _choice(opts.pipeline, PIPELINE_OVERRIDES, "pdd.pipeline"),
        _choice(opts.handoff, HANDOFF_OVERRIDES, "pdd.handoff"),
        bool(_choice(opts.kv_wait, KV_WAIT_OVERRIDES, "pdd.kv_wait")),
    )


def _choice(value: str | None, choices: dict[str, Any], param: str) -> Any:
    if value is None:
        return None
    if value not in choices:
        raise InvalidRequestError(
            f"{param} must be one of {' | '.join(choices)}, got {value!r}", param=param
        )
    return choices[value]


def _prompt_word(body: Any) -> str:
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def _check_stream(body: Any) -> None:
    _check_int_range(body.n, 1, MAX_CHOICES, "n")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )


def _max_tokens(
    given: tuple[int | None, str], n_prompt: int, limits: ServingLimits, where: str
) -> int:
    value, param = given
    limit = limits.max_model_len
    if value is not None and value < 1:
        raise InvalidRequestError(f"{param} must be at least 1, got {value}", param=param)
    if value is None:
        if n_prompt >= limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{where} has {n_prompt} tokens, which leaves no room for the completion. "
                f"Please reduce the length of the {where}.",
                param=where,
            )
        return limit - n_prompt
    if n_prompt + value > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n_prompt + value} tokens ({n_prompt} in the {where}, {value} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            param=param,
        )
    return value


def _float(value: float | None, default: float, lo: float, hi: float, param: str) -> float:
    v = float(default if value is None else value)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise InvalidRequestError(f"{param} must be in [{lo}, {hi}], got {value}", param=param)
    return v


def _top_p(value: float | None, limits: ServingLimits) -> float:
    v = float(limits.defaults.get("top_p", 1.0) if value is None else value)
    if not math.isfinite(v) or not 0.0 < v <= 1.0:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {value}", param="top_p")
    return v


def _top_k(value: int | None, limits: ServingLimits) -> int:
    v = int(limits.defaults.get("top_k", -1) if value is None else value)
    if v < -1 or v > INT32_MAX:
        raise InvalidRequestError(
            f"top_k must be -1 (disabled), 0 (disabled) or in [1, {INT32_MAX}], got {value}",
            param="top_k",
        )
    return -1 if v == 0 else v


def _repetition_penalty(value: float | None, limits: ServingLimits) -> float:
    v = float(limits.defaults.get("repetition_penalty", 1.0) if value is None else value)
    if not math.isfinite(v) or not 0.0 < v <= MAX_REPETITION_PENALTY:
        raise InvalidRequestError(
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {value}",
            param="repetition_penalty",
        )
    return v


def _check_int_range(value: int, lo: int, hi: int, param: str) -> int:
    if not lo <= value <= hi:
        raise InvalidRequestError(f"{param} must be in [{lo}, {hi}], got {value}", param=param)
    return value


def _stop_token_ids(ids: list[int] | None, limits: ServingLimits) -> list[int]:
    if not ids:
        return []
    check_token_ids(ids, limits, "stop_token_ids")
    return list(dict.fromkeys(ids))


def _truncated(prompt_ids: list[int], keep: int | None, limits: ServingLimits) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: as many as
    the context holds)."""
    if keep is None:
        return prompt_ids
    limit = limits.max_model_len
    if keep == -1:
        keep = limit
    if not 1 <= keep <= limit:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be -1 or in [1, {limit}] (max_model_len), got {keep}",
            param="truncate_prompt_tokens",
        )
    return prompt_ids[-keep:]


def _logit_bias(
    bias: dict[str, float] | None, limits: ServingLimits
) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids (JSON object keys, so strings) -> a bias in
    [-100, 100]; sorted by token id."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        check_token_ids([token], limits, "logit_bias")
        out[token] = _float(value, 0.0, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, "logit_bias")
    return tuple(sorted(out.items()))


def _allowed_token_ids(ids: list[int] | None, limits: ServingLimits) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not ids:
        raise InvalidRequestError(
            "allowed_token_ids must name at least one token", param="allowed_token_ids"
        )
    check_token_ids(ids, limits, "allowed_token_ids")
    return tuple(dict.fromkeys(ids))


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(s == "" for s in stops):
        raise InvalidRequestError("stop must not contain an empty string", param="stop")
    return tuple(dict.fromkeys(stops))
