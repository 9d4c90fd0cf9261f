"""Tools in the chat API through the official `openai` client, the router wired to fake
workers that emit a scripted tool call: rendering of tools and tool history, tool calls in
responses and in streams (accumulated by openai's own ChatCompletionStreamState), tool_choice,
and the 400s for what is not served. The pdd-mode test hands off in the middle of a call's
arguments (fake P / RLD / MD)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from pdd.router.text.tool_prompt import ToolPlan, prompt_text
from tests.router.fake_worker import EOS

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris, then the time there?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
HISTORY = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]  # fmt: skip


@pytest.fixture
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url, api_key="unused", max_retries=0, timeout=30)


def say(h, text: str, per_step: int = 1) -> list[int]:
    ids = h.codec.encode(text, add_special_tokens=False) + [EOS]
    for f in h.fakes if hasattr(h, "fakes") else [h.fake]:
        f.script.tokens = list(ids)
        f.script.tokens_per_step = per_step
    return ids


def sent_prompt(h, worker=None) -> str:
    fake = h.fake if worker is None else h.by_id(worker)
    return h.codec.decode(fake.requests[0].prompt_token_ids, skip_special_tokens=False)


def stream_final(client, **kw):
    state = ChatCompletionStreamState(input_tools=kw.get("tools", []))
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    for c in chunks:
        state.handle_chunk(c)
    return state.get_final_completion(), chunks


def test_tool_call_non_streamed(client, router):
    say(router, CALL)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    # SmolLM2's template knows no tools: the router's fallback puts them in the system turn.
    prompt = sent_prompt(router)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER) in prompt and "<tool_call>" in prompt


def test_tool_call_streamed_as_the_openai_client_accumulates_it(client, router):
    say(router, "Checking. " + CALL)
    final, chunks = stream_final(client, messages=ASK, tools=TOOLS)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id == call.id and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 5  # the arguments came in fragments, one per token
    assert not any("tool_call>" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_tool_history_reaches_the_prompt(client, router):
    say(router, "It is 18 C and sunny in Paris; the time there is 14:05.")
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    prompt = sent_prompt(router)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert '{"name": "get_time", "arguments": {}}' in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert "<tool_response>\n14:05\n</tool_response>" in prompt
    plan = ToolPlan("hermes", tuple(TOOLS), "auto")
    assert prompt == prompt_text(router.codec, _as_template_messages(HISTORY), plan)


def _as_template_messages(messages):
    return [{**m, "content": m["content"] or ""} for m in messages]


def test_named_tool_choice_forces_the_call_opening(client, router):
    say(router, '{"city": "Paris"}}\n</tool_call>')
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"}
    )  # fmt: skip
    assert sent_prompt(router).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
    )
    say(router, '{"city": "Paris"}}\n</tool_call>', per_step=2)
    final, _ = stream_final(client, messages=ASK, tools=TOOLS, tool_choice=choice)
    assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == {
        "city": "Paris"
    }


def test_tool_choice_none_returns_text(client, router):
    say(router, CALL)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"


def test_malformed_call_is_text_not_an_error(client, router):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    say(router, bad)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert r.choices[0].message.content == bad and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(client, router):
    two = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    say(router, two)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    say(router, two)
    kw = {"messages": ASK, "tools": TOOLS, "parallel_tool_calls": False}
    r = client.chat.completions.create(model=MODEL, **kw)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    say(router, two)
    final, _ = stream_final(client, **kw)
    assert [c.function.name for c in final.choices[0].message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),  # no schema
        ({"bad_words": [" "]}, "bad_words"),  # served; a word of no tokens
        ({"echo": True}, "echo"),  # completions' is served, chat's is not
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"add_special_tokens": True}, "add_special_tokens"),  # chat's default: false
        ({"logit_bias": {"1": 101}}, "logit_bias"),  # served; out of OpenAI's [-100, 100]
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ],
)  # fmt: skip
def test_unserved_or_bad_tool_fields_are_400_naming_the_parameter(router, extra, param):
    body = {"model": MODEL, "messages": ASK, **extra}
    r = httpx.post(router.url + "/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_annotation_fields_stay_accepted(client, router):
    say(router, "ok")
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, user="u1", metadata={"k": "v"}, store=False,
        response_format={"type": "text"}, extra_body={"service_tier": "auto"},
    )  # fmt: skip
    assert r.choices[0].message.content == "ok"


def test_completions_refuse_unserved_fields_too(router):
    body = {"model": MODEL, "prompt": "hi", "guided_whitespace_pattern": " *"}
    r = httpx.post(router.url + "/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_whitespace_pattern"
    # completions' add_special_tokens defaults to true (chat's to false)
    for field, value in (("add_special_tokens", False), ("return_token_ids", True)):
        body = {"model": MODEL, "prompt": "hi", field: value}
        r = httpx.post(router.url + "/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    say(router, "ok")  # the defaults, said out loud, are served
    plain = {"model": MODEL, "prompt": "hi", "add_special_tokens": True, "echo": False,
             "spaces_between_special_tokens": True, "truncation_side": "left"}  # fmt: skip
    assert httpx.post(router.url + "/completions", json=plain, timeout=10).status_code == 200


@pytest.mark.parametrize("handoff", ["one_shot", "catch_up"])
def test_streamed_tool_call_survives_a_handoff_inside_its_arguments(pdd, handoff):
    args = {"city": "Paris", "unit": "c", "note": " ".join(f"w{i}" for i in range(40))}
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
    )
    ids = say(pdd, text)
    pdd.by_id("rld0").script.step_delay_s = 0.02  # RLD decodes ~40 tokens before MD has
    pdd.by_id("md0").kv.land_delay_s = 0.8  # the prompt's KV
    client = openai.OpenAI(base_url=pdd.url, api_key="unused", max_retries=0, timeout=30)
    extra = {"pdd": {"pipeline": "p_rld_md", "handoff": handoff}}
    final, chunks = stream_final(client, messages=ASK, tools=TOOLS, extra_body=extra)
    (call,) = final.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", args)
    record = chunks[-1].model_extra["pdd"]
    assert record["handoff"] == handoff and record["handoff_rounds"] >= 1
    # RLD emitted some of the tokens after P's first one and MD the rest: the switch fell
    # inside the call (its name ends within the first 20 tokens, its arguments run to the end).
    name_end = len(pdd.codec.encode(text[: text.index('"arguments"')], add_special_tokens=False))
    assert name_end < 1 + record["rld_tokens"] < len(ids) - 5
