"""Request fields beyond sampling: tools and tool_choice, structured outputs, and the fields
pdd refuses.

Pure functions (no I/O); each failure is an ``InvalidRequestError`` (400) naming the
parameter. A field that would change the answer and is not served is refused, never dropped.
"""

from __future__ import annotations

import json
from typing import Any

from pdd.errors import InvalidRequestError
from pdd.router.http.schemas import (
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    NamedToolChoice,
    TokenizeRequest,
)
from pdd.router.text.tokenizer import ChatOptions, TextCodec
from pdd.router.text.tool_prompt import ToolPlan, call_constraint
from pdd.router.types import Constraint

# Fields (OpenAI's or vLLM's extras) that change the answer and that pdd does not serve: a
# request that sets one to anything but null or the value here (its default) gets a 400 naming
# it. ``functions``/``function_call`` are OpenAI's deprecated spelling of tools; chat's
# ``echo`` (vLLM's: the answer repeats the last message) is not served, completions' is.
UNSERVED_FIELDS: dict[str, Any] = {
    "guided_whitespace_pattern": None, "functions": None, "function_call": None,
    "use_beam_search": False, "length_penalty": 1, "chat_template": None, "documents": None,
    "logits_processors": None, "vllm_xargs": None, "prediction": None, "audio": None,
    "modalities": ["text"], "web_search_options": None,
    "echo": False, "spaces_between_special_tokens": True, "truncation_side": "left",
    "logprob_token_ids": None, "prompt_embeds": None, "return_tokens_as_token_ids": False,
    "return_token_ids": False, "repetition_detection": None, "thinking_token_budget": None,
    "watermarking": False,
}  # fmt: skip


def tool_plan(body: ChatCompletionRequest | TokenizeRequest, parser: str | None) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (400 naming the parameter); None: none."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError(
                "tool_choice needs tools: no tools were given", param="tool_choice"
            )
        return None
    if parser is None:
        raise InvalidRequestError(
            "this server has no tool parser (model.tool_parser is null)", param="tools"
        )
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        chosen = choice.function.name
    else:
        chosen = choice or "auto"
    tools = tuple(t.model_dump(exclude_none=True) for t in body.tools)
    return ToolPlan(parser, tools, chosen, parallel=body.parallel_tool_calls)


def chat_options(body: ChatTemplateFields) -> ChatOptions:
    """How the request's conversation becomes its prompt (400 for a bad combination)."""
    return ChatOptions(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs or {},
    )


def with_tool_call(structured: Constraint | None, plan: ToolPlan | None) -> Constraint | None:
    """The request's constraint once tools are known: a forced call (tool_choice required or
    a named function) is constrained to its tools' schemas; with another constraint too, 400."""
    if plan is None or (forced := call_constraint(plan)) is None:
        return structured
    if structured is not None:
        raise InvalidRequestError(
            f"tool_choice {plan.choice!r} forces a tool call; it cannot be combined with "
            f"{structured.param}",
            param="tool_choice",
        )
    return forced


def check_unserved(body: ChatCompletionRequest | CompletionRequest | TokenizeRequest) -> None:
    """400 for a field that would change the answer and is not served (never a silent drop).
    Other unknown fields (annotations such as ``metadata``, ``store``) are accepted."""
    extra = body.model_extra or {}
    plain = {**UNSERVED_FIELDS, "add_special_tokens": isinstance(body, CompletionRequest)}
    for name, default in plain.items():
        value = extra.get(name)
        if value is not None and value != default:
            raise InvalidRequestError(f"{name} is not supported by this server", param=name)


MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default, counted after tokenization


def bad_words(words: list[str] | None, codec: TextCodec) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` tokenized as vLLM tokenizes them (``SamplingParams.
    update_from_tokenizer``): each word as given (left-stripped) and, where that is a new
    token sequence of the same length, with a leading space, so it is banned both at the
    start of the text and inside it. 400 naming ``bad_words`` for a word of no tokens or too
    many."""
    out: list[tuple[int, ...]] = []
    for word in words or []:
        plain = codec.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise InvalidRequestError(
                "bad_words entries must tokenize to at least one token", param="bad_words"
            )
        out.append(tuple(plain))
        spaced = codec.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
        if len(out) > MAX_BAD_WORDS:
            raise InvalidRequestError(
                f"too many bad words after tokenization: {len(out)}, at most {MAX_BAD_WORDS}",
                param="bad_words",
            )
    return tuple(out)


# --- structured outputs -----------------------------------------------------------------
# Served on every pipeline by the workers' constraint processor (pdd.engine.constraint);
# here only the shape is checked (a bad schema, regex or grammar is the worker's 400, which
# names the same parameter). vLLM 0.32's ``structured_outputs`` and the older ``guided_*``
# extras are both accepted.

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}  # fmt: skip
_SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_SO_DEFAULTS = {"disable_any_whitespace": False, "disable_additional_properties": False,
                "whitespace_pattern": None, "structural_tag": None}  # fmt: skip
_BACKENDS = (None, "auto", "xgrammar")


def constraint(body: ChatCompletionRequest | CompletionRequest) -> Constraint | None:
    """The request's structured-output constraint (None: free text). 400 naming the field for
    a malformed one, for two at once, and for options pdd does not serve."""
    extra = body.model_extra or {}
    found: list[Constraint] = []
    rf = extra.get("response_format")
    if rf is not None:
        c = _from_response_format(rf)
        found += [c] if c is not None else []
    so = extra.get("structured_outputs")
    if so is not None:
        found.append(_from_structured_outputs(so))
    for name, key in _GUIDED.items():
        if extra.get(name) is not None:
            found.append(_make(_SO_KINDS[key], extra[name], name))
    backend = extra.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise InvalidRequestError(
            f"guided_decoding_backend {backend!r} is not served (this server uses xgrammar)",
            param="guided_decoding_backend",
        )
    if len(found) > 1:
        names = " and ".join(c.param for c in found)
        raise InvalidRequestError(
            f"only one structured-output constraint per request: got {names}",
            param=found[1].param,
        )
    return found[0] if found else None


def _from_response_format(rf: Any) -> Constraint | None:
    param = "response_format"
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", param)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or js.get("schema") is None:
            raise InvalidRequestError(
                "response_format json_schema needs json_schema.schema (a JSON Schema object)",
                param=param,
            )
        if not isinstance(js.get("strict", False), bool | None):
            raise InvalidRequestError("json_schema.strict must be a boolean", param=param)
        return _make("json_schema", js["schema"], param)
    raise InvalidRequestError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param=param,
    )


def _from_structured_outputs(so: Any) -> Constraint:
    param = "structured_outputs"
    if not isinstance(so, dict):
        raise InvalidRequestError("structured_outputs must be an object", param=param)
    for key, default in _SO_DEFAULTS.items():
        if so.get(key, default) != default:
            raise InvalidRequestError(f"structured_outputs.{key} is not served", param=param)
    unknown = set(so) - set(_SO_DEFAULTS) - set(_SO_KINDS) - {"json_object"}
    if unknown:
        raise InvalidRequestError(
            f"unknown structured_outputs field(s): {', '.join(sorted(unknown))}", param=param
        )
    given = [k for k in (*_SO_KINDS, "json_object") if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
            param=param,
        )
    key = given[0]
    if key == "json_object":
        return Constraint("json_object", "", param)
    return _make(_SO_KINDS[key], so[key], param)


def _make(kind: str, value: Any, param: str) -> Constraint:
    """A constraint of ``kind`` from the request's value, its shape checked."""
    if kind == "json_schema":
        if isinstance(value, str):  # guided_json / structured_outputs.json may be JSON text
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"{param}: the schema is not JSON: {exc}", param=param
                ) from exc
        if not isinstance(value, dict | bool):
            raise InvalidRequestError(f"{param}: a JSON schema must be an object", param=param)
        return Constraint(kind, json.dumps(value), param)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(v, str) for v in value)):  # fmt: skip
            raise InvalidRequestError(
                f"{param}: choices must be a non-empty list of strings", param=param
            )
        return Constraint(kind, json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param}: must be a non-empty string", param=param)
    return Constraint(kind, value, param)
