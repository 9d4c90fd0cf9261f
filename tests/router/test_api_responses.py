"""OpenAI's Responses API (``/v1/responses``) through the official `openai` client, the router
wired to a fake worker: a text answer, a function call and its output sent back as input
items (the prompt is the chat prompt of the same conversation), the streamed events as the
client accumulates them, structured output, and the 400s naming the Responses field."""

from __future__ import annotations

import json

import openai
import pytest

from tests.router.test_api_tools import CALL, TOOLS, say

MODEL = "SmolLM2-135M-Instruct"
# the same tools in the Responses API's flat shape
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def sent_prompt(router) -> str:
    """The prompt of the worker's latest Generate."""
    ids = router.fake.requests[-1].prompt_token_ids
    return router.codec.decode(ids, skip_special_tokens=False)


@pytest.fixture
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url, api_key="unused", max_retries=0, timeout=30)


def test_text_answer_with_usage(client, router):
    ids = say(router, "Paris is the capital.")
    r = client.responses.create(
        model=MODEL, input="Capital of France?", instructions="Be brief.", max_output_tokens=50
    )
    assert (r.status, r.output_text) == ("completed", "Paris is the capital.")
    assert r.model_extra["pdd"]["pipeline"] == "colocated"  # the record, as on chat
    assert [item.type for item in r.output] == ["message"]
    assert (r.usage.output_tokens, r.usage.input_tokens > 0) == (len(ids), True)
    prompt = sent_prompt(router)
    assert "<|im_start|>system\nBe brief." in prompt and "Capital of France?" in prompt
    r = client.responses.create(model=MODEL, input="Capital of France?", max_output_tokens=3)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")


def test_a_function_call_and_its_output_round_trip(client, router):
    say(router, CALL)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=FLAT_TOOLS)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == (
        "get_weather",
        {"city": "Paris", "unit": "c"},
    )
    say(router, "It is 18 C.")
    history = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                      "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]  # fmt: skip
    r = client.responses.create(model=MODEL, input=history, tools=FLAT_TOOLS)
    assert r.output_text == "It is 18 C."
    prompt = sent_prompt(router)
    assert '"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt


def test_streamed_events_accumulate_to_the_response(client, router):
    say(router, "Hello there, friend.", per_step=2)
    with client.responses.stream(model=MODEL, input="Say hello") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == "Hello there, friend." and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and final.usage.output_tokens > 0
    assert final.model_extra["pdd"]["pipeline"] == "colocated"
    assert kinds.count("response.output_text.delta") > 1
    say(router, CALL, per_step=3)
    with client.responses.stream(model=MODEL, input="Weather?", tools=FLAT_TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] == "Paris"
    assert "response.function_call_arguments.delta" in kinds
    assert "response.output_text.delta" not in kinds  # the call's text is not shown


def test_structured_output_and_tool_choice_reach_the_worker(client, router):
    say(router, '{"a": 1}')
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    r = client.responses.create(model=MODEL, input="JSON please", text={"format": fmt})
    assert r.output_text == '{"a": 1}'
    sent = router.fake.requests[-1].constraint
    assert (sent.kind, json.loads(sent.spec)) == ("json_schema", {"type": "object"})


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"previous_response_id": "resp_1"}, "previous_response_id"),
     ({"background": True}, "background"),
     ({"include": ["message.output_text.logprobs"]}, "include"),
     ({"tools": [{"type": "web_search"}]}, "tools"),
     ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
     ({"max_output_tokens": 0}, "max_output_tokens"),
     ({"text": {"format": {"type": "xml"}}}, "text.format"),
     ({"text": {"format": "json"}}, "text.format"), ({"include": 5}, "include"),
     ({"tools": [{"type": "function", "parameters": {}}]}, "tools")],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_the_field(client, router, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": MODEL, "input": "x", **extra})
    assert info.value.body["param"] == param, info.value.body
    assert router.fake.requests == []
