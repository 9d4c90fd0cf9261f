"""Request fields beyond sampling: tools and tool_choice, and the fields pdd refuses.

Pure functions (no I/O); each failure is an ``InvalidRequestError`` (400) naming the
parameter. A field that would change the answer and is not served is refused, never dropped.
"""

from __future__ import annotations

from typing import Any

from pdd.errors import InvalidRequestError
from pdd.router.http.schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from pdd.router.text.tool_prompt import ToolPlan

# Fields (OpenAI's or vLLM's extras) that change the answer and that pdd does not serve yet:
# a request that sets one gets a 400 naming it. ``functions``/``function_call`` are OpenAI's
# deprecated spelling of tools.
UNSERVED_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend", "logit_bias",
    "functions", "function_call", "min_p", "bad_words", "allowed_token_ids", "prompt_logprobs",
    "use_beam_search", "length_penalty", "truncate_prompt_tokens", "chat_template",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents",
    "logits_processors", "vllm_xargs", "prediction", "audio", "modalities", "web_search_options",
)  # fmt: skip


def tool_plan(body: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
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


def check_unserved(body: ChatCompletionRequest | CompletionRequest) -> None:
    """400 for a field that would change the answer and is not served (never a silent drop).
    Other unknown fields (annotations such as ``metadata``, ``store``) are accepted."""
    extra = body.model_extra or {}
    for name in UNSERVED_FIELDS:
        if name in extra and extra[name] is not None and not _is_plain(name, extra[name]):
            raise InvalidRequestError(f"{name} is not supported by this server", param=name)


def _is_plain(name: str, value: Any) -> bool:
    """Values of an unserved field that ask for nothing beyond the default."""
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name in ("logit_bias", "chat_template_kwargs"):
        return value == {}
    if name in ("use_beam_search", "echo", "continue_final_message"):
        return value is False
    if name == "add_generation_prompt":
        return value is True
    if name == "modalities":
        return value == ["text"]
    if name == "min_p":
        return value == 0
    if name == "length_penalty":
        return value == 1
    return False
