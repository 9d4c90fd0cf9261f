"""pdd's tool-call parsers agree with vLLM 0.32's own (Hermes2ProToolParser,
Llama3JsonToolParser) on a corpus of model outputs, malformed ones included; streamed parsing
gives the same calls as whole-text parsing whatever the chunking. No engine starts (vLLM's
parsers are plain Python over text)."""

from __future__ import annotations

import json

import pytest
import vllm.tool_parsers.hermes_tool_parser as vllm_hermes  # vLLM is pinned: never skipped
import vllm.tool_parsers.llama_tool_parser as vllm_llama

from pdd.router.text.tool_calls import ToolCallStream, extract

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
HERMES = [
    "The capital of France is Paris.",
    f"<tool_call>\n{W}\n</tool_call>",
    f"Let me check. <tool_call>\n{W}\n</tool_call>",
    f'<tool_call>{W}</tool_call>\n<tool_call>{{"name": "f", "arguments": {{}}}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"q": "a \\"quoted\\" }"}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"nested": {"a": [1, {"b": null}]}}}</tool_call>',
    '<tool_call>{"arguments": {"x": 1}, "name": "late_name"}</tool_call>',
    '<tool_call>{"name": "émoji 🚀", "arguments": {"t": "世界"}}</tool_call>',
    f"<tool_call>\n{W}",  # cut before the end tag (max_tokens): vLLM still parses it
    '<tool_call>{"name": "f", "arguments": {"a": </tool_call>',  # malformed JSON
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments
    '<tool_call>[{"name": "f", "arguments": {}}]</tool_call>',  # a list, not an object
    "<tool_call>not json at all</tool_call>",
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
    "text with </tool_call> only",
    "<tool_call",
]
LLAMA = [
    "The capital of France is Paris.",
    W,
    '<|python_tag|>{"name": "f", "parameters": {"x": 1}}',
    '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {"y": "z"}}',
    'Sure: {"name": "f", "arguments": {"a": [1, 2]}} done',
    '{"a": 1}',  # no name: text
    '{"name": "f", "arguments": {"a": ',  # cut JSON
    "{not json}",
    '{"name": "f"}',  # neither arguments nor parameters
]


class _Tokenizer:
    """What the two vLLM parsers read from a tokenizer: a vocab with Llama's <|python_tag|>."""

    def get_vocab(self) -> dict[str, int]:
        return {"<|python_tag|>": 1, "<tool_call>": 2, "</tool_call>": 3}


def _vllm(parser_cls, text: str) -> tuple[str | None, list[tuple[str, object]]]:
    info = parser_cls(_Tokenizer()).extract_tool_calls(text, request=None)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    return info.content, calls


def _ours(parser: str, text: str) -> tuple[str | None, list[tuple[str, object]]]:
    found = extract(parser, text)
    return found.content, [(c.name, json.loads(c.arguments)) for c in found.calls]


@pytest.mark.parametrize("text", HERMES)
def test_hermes_matches_vllm(text):
    assert _ours("hermes", text) == _vllm(vllm_hermes.Hermes2ProToolParser, text)


@pytest.mark.parametrize("text", LLAMA)
def test_llama3_json_matches_vllm(text):
    assert _ours("llama3_json", text) == _vllm(vllm_llama.Llama3JsonToolParser, text)


def streamed(parser: str, text: str, step: int, prefix: str = "") -> tuple[str, list]:
    """Feed ``text`` in ``step``-character pieces; accumulate as an OpenAI client does."""
    stream = ToolCallStream(parser, prefix=prefix)
    content, calls = "", {}
    pieces = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)]
    for piece, deltas in [*pieces, stream.flush()]:
        content += piece
        for d in deltas:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.id is not None:
                assert call["name"] is None, "a call's header comes once, first"
                call["name"] = d.name
            else:
                assert call["name"] is not None, "arguments only after the header"
            call["arguments"] += d.arguments
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


WELL_FORMED = {"hermes": [t for t in HERMES[:9]], "llama3_json": [LLAMA[1], LLAMA[2], LLAMA[3]]}


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_streamed_calls_equal_whole_text_calls(parser, step):
    for text in WELL_FORMED[parser]:
        whole = extract(parser, text)
        content, calls = streamed(parser, text, step)
        assert [(n, json.loads(a)) for n, a in calls] == [
            (c.name, json.loads(c.arguments)) for c in whole.calls
        ], text
        assert content == (whole.content or ""), text


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_malformed_call_before_its_name_is_text(step):
    text = "<tool_call>not json at all</tool_call>"
    assert streamed("hermes", text, step) == (text, [])
    assert streamed("llama3_json", "{not json}", step) == ("{not json}", [])
    assert streamed("hermes", "plain <tool", step) == ("plain <tool", [])


def test_forced_prefix_is_parsed_with_the_output():
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": '
    content, calls = streamed("hermes", '{"city": "Paris"}}\n</tool_call>', 2, prefix=prefix)
    assert (content, calls) == ("", [("get_weather", '{"city": "Paris"}')])


def test_random_chunkings_give_the_whole_text_calls():
    import random

    rng = random.Random(18)
    for parser, texts in WELL_FORMED.items():
        for text in texts:
            want = [(c.name, json.loads(c.arguments)) for c in extract(parser, text).calls]
            for _ in range(20):
                stream, calls, cut = ToolCallStream(parser), {}, 0
                pieces = []
                while cut < len(text):
                    n = rng.randint(1, 6)
                    pieces.append(stream.feed(text[cut : cut + n]))
                    cut += n
                for _, deltas in [*pieces, stream.flush()]:
                    for d in deltas:
                        calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
                assert [(n, json.loads(a)) for n, a in calls.values()] == want, text
