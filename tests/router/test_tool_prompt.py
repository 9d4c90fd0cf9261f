"""The prompt side of tools: a template that reads ``tools`` gets them (and decoded call
arguments) as transformers passes them; one that does not gets the fallback rewrite; the
forced opening of a required / named call."""

from __future__ import annotations

import json

from pdd.router.text.tokenizer import TextCodec
from pdd.router.text.tool_prompt import ToolPlan, prompt_text, template_messages
from tests.router.test_api_tools import HISTORY, TOOLS

NATIVE = (  # the shape of Qwen2.5's template, cut down
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}:{{ c.function.arguments.city }}]"
    "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _messages():
    return [{**m, "content": m["content"] or ""} for m in HISTORY]


def test_a_template_that_reads_tools_gets_them_natively(codec):
    native = TextCodec(codec._tok, {}, NATIVE)
    assert native.knows_tools and not codec.knows_tools
    plan = ToolPlan("hermes", tuple(TOOLS), "auto")
    text = prompt_text(native, _messages(), plan)
    assert text.startswith("<tools>get_weather;get_time;</tools>\n")
    # arguments decoded to an object; the tool message carries its tool_call_id
    assert "<assistant>[get_weather:Paris]<tool>18 C, sunny(call_1)<assistant>" in text


def test_fallback_hermes_groups_tool_results_into_one_user_turn():
    msgs = [*_messages()[:2], {"role": "tool", "tool_call_id": "a", "content": "r1"},
            {"role": "tool", "tool_call_id": "b", "content": "r2"}]  # fmt: skip
    out = template_messages(msgs, ToolPlan("hermes", tuple(TOOLS), "auto"), native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("# Tools\n") and json.dumps(TOOLS[0]) in out[0]["content"]
    assert out[3]["content"] == (
        "<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>"
    )


def test_fallback_llama3_json_format():
    out = template_messages(
        _messages(), ToolPlan("llama3_json", tuple(TOOLS), "auto"), native=False
    )
    assert out[0]["role"] == "system" and '"parameters": dictionary' in out[0]["content"]
    assert out[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert out[3] == {"role": "ipython", "content": "18 C, sunny"}


def test_history_without_tools_in_the_request_still_keeps_the_calls():
    out = template_messages(_messages(), None, native=False)
    assert out[0]["role"] == "user" and "<tool_call>" in out[1]["content"]


def test_forced_prefix():
    assert ToolPlan("hermes", (), "auto").forced_prefix == ""
    assert ToolPlan("hermes", (), "none").forced_prefix == ""
    assert ToolPlan("hermes", (), "required").forced_prefix == '<tool_call>\n{"name": "'
    assert ToolPlan("hermes", (), "f").forced_prefix == '<tool_call>\n{"name": "f", "arguments": '
    assert ToolPlan("llama3_json", (), "f").forced_prefix == '{"name": "f", "parameters": '
