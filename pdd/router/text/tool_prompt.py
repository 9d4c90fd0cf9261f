"""Tools on the prompt side: what the chat template gets, and the text forced after it.

A template that knows tools (its source reads a ``tools`` variable, as Qwen's, Hermes' and
Llama-3.1's do) is rendered the way transformers and vLLM render it:
``template.render(messages=..., tools=[{"type": "function", "function": {...}}, ...])``, with
assistant ``tool_calls`` whose JSON ``arguments`` are decoded to objects (vLLM does the same)
and ``role: "tool"`` messages carrying ``tool_call_id``.

Fallback for a template that knows no tools (the default model, SmolLM2-135M-Instruct: its
template prints ``role`` and ``content`` only): the router rewrites the conversation in the
format of the configured ``model.tool_parser`` before rendering, so no part of the tool
history is lost:

    hermes       system  += "# Tools ... <tools>{tool json per line}</tools> ..."  (Qwen2.5's words)
                 assistant tool_calls -> "<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>"
                 tool messages (consecutive ones grouped) -> one user turn of
                 "<tool_response>\\n...\\n</tool_response>"
    llama3_json  system  += Llama-3.1's JSON tool instructions and the tool list
                 assistant tool_calls -> '{"name": .., "parameters": ..}' joined by "; "
                 tool messages -> role "ipython"

``tool_choice`` "required" or a named function is served by forcing the opening of a call
after the generation prompt (``ToolPlan.forced_prefix``): the model continues inside the call,
so the name is chosen (named) or must be one of the tools' (required). ``call_constraint``
then constrains the rest of the call (structured outputs, ``pdd.engine.constraint``): one of
the tools' names (required), arguments valid against that tool's ``parameters`` schema, and
the call's closing text, then the end: exactly one call, whose arguments always parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdd.errors import InvalidRequestError
from pdd.router.text.tokenizer import CHAT_DEFAULTS, ChatOptions, TextCodec
from pdd.router.types import Constraint

HERMES_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
LLAMA3_INSTRUCTIONS = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name '
    "and its value}}. Do not use variables.\n\n{tools}"
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request's tools, validated. ``choice``: none | auto | required | a tool name."""

    parser: str
    tools: tuple[dict[str, Any], ...]
    choice: str
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the output is searched for tool calls (not for tool_choice none)."""
        return self.choice != "none"

    @property
    def forced_prefix(self) -> str:
        """Text after the generation prompt that opens a call (required / named), else ""."""
        if self.choice in ("none", "auto"):
            return ""
        name = "" if self.choice == "required" else self.choice
        head = '{"name": "' + (json.dumps(name)[1:-1] + '", ' if name else "")
        if name:
            head += '"arguments": ' if self.parser == "hermes" else '"parameters": '
        return ("<tool_call>\n" + head) if self.parser == "hermes" else head


CALL_CLOSE = {"hermes": "}\n</tool_call>", "llama3_json": "}"}  # after the arguments


def call_constraint(plan: ToolPlan) -> Constraint | None:
    """The constraint on what follows ``plan.forced_prefix`` (required / named), else None:
    the name (required: one alternative per tool) with the arguments key, the arguments per
    the tool's ``parameters`` (none: any object), the call's close."""
    if plan.choice in ("none", "auto"):
        return None
    key = '"arguments": ' if plan.parser == "hermes" else '"parameters": '
    close = CALL_CLOSE[plan.parser]
    alternatives = []
    for tool in plan.tools:
        fn = tool["function"]
        if plan.choice not in ("required", fn["name"]):
            continue
        prefix = "" if plan.choice != "required" else json.dumps(fn["name"])[1:-1] + '", ' + key
        schema = fn.get("parameters") or {"type": "object"}
        alternatives.append({"prefix": prefix, "schema": schema, "suffix": close})
    return Constraint("tool_call", json.dumps(alternatives), "tools")


def prompt_text(
    codec: TextCodec, messages: list[dict[str, Any]], plan: ToolPlan | None,
    options: ChatOptions = CHAT_DEFAULTS,
) -> str:  # fmt: skip
    """The whole prompt of a chat request: the rendered template, then the forced prefix."""
    native = codec.knows_tools
    tools = list(plan.tools) if plan is not None and native else None
    forced = plan.forced_prefix if plan is not None else ""
    if forced and not options.add_generation_prompt:
        raise InvalidRequestError(
            f"tool_choice {plan.choice!r} opens a tool call after the generation prompt; it "
            "needs add_generation_prompt true",
            param="tool_choice",
        )
    rendered = codec.render_chat(
        template_messages(messages, plan, native=native), options=options, tools=tools
    )
    return rendered + forced


def prompt_ids(
    codec: TextCodec, messages: list[dict[str, Any]], plan: ToolPlan | None,
    options: ChatOptions = CHAT_DEFAULTS,
) -> list[int]:  # fmt: skip
    """``prompt_text`` tokenized (the template carries its own special tokens)."""
    return codec.encode(prompt_text(codec, messages, plan, options), add_special_tokens=False)


def template_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, *, native: bool
) -> list[dict[str, Any]]:
    """The messages to render: native (template knows tools) or rewritten (fallback)."""
    if native:
        return [_native(m) for m in messages]
    if plan is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages
    parser = plan.parser if plan is not None else "hermes"
    out = _fallback_history(messages, parser)
    if plan is not None and plan.tools:
        out = _with_tool_instructions(out, plan)
    return out


def _native(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    decoded = []
    for call in calls:
        fn = dict(call["function"])
        fn["arguments"] = _decode_args(fn["arguments"])
        decoded.append({**call, "function": fn})
    return {**message, "tool_calls": decoded}


def _decode_args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the string as sent


def _fallback_history(messages: list[dict[str, Any]], parser: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append(_tool_result(m, parser, out))
            continue
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        texts = [_call_text(c["function"], parser) for c in calls]
        joined = "\n".join(texts) if parser == "hermes" else "; ".join(texts)
        content = f"{m['content']}\n{joined}" if m["content"] else joined
        out.append({"role": m["role"], "content": content})
    return [{k: v for k, v in o.items() if k != "_tool_group"} for o in out if o is not None]


def _call_text(function: dict[str, Any], parser: str) -> str:
    args = _decode_args(function["arguments"])
    if parser == "hermes":
        body = json.dumps({"name": function["name"], "arguments": args}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"
    return json.dumps({"name": function["name"], "parameters": args}, ensure_ascii=False)


def _tool_result(m: dict[str, Any], parser: str, out: list[dict[str, Any]]) -> Any:
    """One tool result; hermes groups consecutive results into one user turn (returns None
    when it extended the previous one)."""
    if parser != "hermes":
        return {"role": "ipython", "content": m["content"]}
    block = f"<tool_response>\n{m['content']}\n</tool_response>"
    prev = out[-1] if out else None
    if prev is not None and prev.get("_tool_group"):
        prev["content"] += "\n" + block
        return None
    return {"role": "user", "content": block, "_tool_group": True}


def _with_tool_instructions(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
    template = HERMES_INSTRUCTIONS if plan.parser == "hermes" else LLAMA3_INSTRUCTIONS
    text = template.format(tools=listing)
    clean = messages
    if clean and clean[0]["role"] == "system":
        first = clean[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *clean[1:]]
    return [{"role": "system", "content": text}, *clean]
