"""Structured outputs in the router (fake workers): which request fields become a constraint,
the 400s for malformed ones, and the constraint every tier's Generate carries, resumed from
the tokens already emitted (P, RLD, MD after One-Shot and Catch-Up, a takeover).

The grammar itself runs in the workers (``pdd.engine.constraint``, tested in
tests/engine/test_constraint.py and end to end in tests/e2e/test_pdd_local.py)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from pdd.errors import InvalidRequestError
from pdd.router.fleet.workers import rpc_error
from pdd.router.http.request_fields import constraint
from pdd.router.http.schemas import ChatCompletionRequest, CompletionRequest
from pdd.router.types import Constraint
from tests.router.test_pdd_flow import MODEL, complete, prompt_ids, script
from tests.router.test_pdd_recovery import spares, spares_harness  # noqa: F401 (fixtures)

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
ASK = [{"role": "user", "content": "Answer in JSON."}]


def _of(**extra) -> Constraint | None:
    return constraint(CompletionRequest.model_validate({"model": MODEL, "prompt": "p", **extra}))


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Constraint("json_object", "", "response_format")),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "r", "schema": SCHEMA, "strict": True}}},
         Constraint("json_schema", json.dumps(SCHEMA), "response_format")),
        ({"structured_outputs": {"json": SCHEMA}},
         Constraint("json_schema", json.dumps(SCHEMA), "structured_outputs")),
        ({"structured_outputs": {"regex": "a+"}}, Constraint("regex", "a+", "structured_outputs")),
        ({"structured_outputs": {"choice": ["x", "y"]}},
         Constraint("choice", '["x", "y"]', "structured_outputs")),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}},
         Constraint("grammar", 'root ::= "a"', "structured_outputs")),
        ({"structured_outputs": {"json_object": True}},
         Constraint("json_object", "", "structured_outputs")),
        ({"guided_json": json.dumps(SCHEMA)}, Constraint("json_schema", json.dumps(SCHEMA), "guided_json")),
        ({"guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"},
         Constraint("regex", "[0-9]+", "guided_regex")),
        ({"guided_choice": ["yes", "no"]}, Constraint("choice", '["yes", "no"]', "guided_choice")),
        ({"guided_grammar": 'root ::= "a"'}, Constraint("grammar", 'root ::= "a"', "guided_grammar")),
    ],
)  # fmt: skip
def test_fields_that_become_a_constraint(extra, want):
    assert _of(**extra) == want
    chat = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, **extra})
    assert constraint(chat) == want


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "json_schema.schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "type must be"),
        ({"response_format": "json"}, "response_format", "type must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
         "response_format", "must be an object"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "non-empty list"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
         "structured_outputs", "disable_any_whitespace is not served"),
        ({"structured_outputs": {"regex": "a", "nope": 1}}, "structured_outputs", "unknown"),
        ({"structured_outputs": "a+"}, "structured_outputs", "must be an object"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "only one"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"},
         "guided_decoding_backend", "not served"),
    ],
)  # fmt: skip
def test_malformed_constraints_are_400_naming_the_parameter(extra, param, fragment):
    with pytest.raises(InvalidRequestError) as err:
        _of(**extra)
    assert err.value.param == param and fragment in err.value.message, err.value.message


def test_the_http_400_names_the_parameter(router):
    body = {"model": MODEL, "messages": ASK, "guided_choice": []}
    r = httpx.post(router.url + "/chat/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice"
    assert not router.fake.requests  # refused before any worker saw it


def test_a_workers_400_keeps_the_parameter_it_names():
    """A schema the worker's grammar backend refuses comes back as INVALID_ARGUMENT with
    trailing metadata ``pdd-param``: the router's 400 names the same parameter."""
    meta = grpc.aio.Metadata(("pdd-param", "response_format"))
    exc = grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), meta, details="bad schema"
    )
    err = rpc_error(exc, "p0", "Generate")
    assert isinstance(err, InvalidRequestError)
    assert (err.param, err.message) == ("response_format", "bad schema")


def test_colocated_generate_carries_the_constraint(router):
    router.fake.script.tokens = router.codec.encode('{"a": "x"}', add_special_tokens=False) + [2]
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    body = {"model": MODEL, "messages": ASK, "response_format": rf, "temperature": 0}
    r = httpx.post(router.url + "/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"a": "x"}
    (req,) = router.fake.requests
    c = req.constraint
    assert (c.kind, c.spec, list(c.resume), c.param) == (
        "json_schema", json.dumps(SCHEMA), [], "response_format"
    )  # fmt: skip


def _resumes_match_prompts(h, workers: list[str], origin: list[int]) -> list[int]:
    """Every Generate's constraint resumes from exactly the tokens after the original
    prompt (what the client had seen when it was sent); returns the resume lengths."""
    lengths = []
    for w in workers:
        for req in h.by_id(w).requests:
            assert req.HasField("constraint"), w
            assert list(req.prompt_token_ids[: len(origin)]) == origin
            assert list(req.constraint.resume) == list(req.prompt_token_ids[len(origin) :]), w
            assert (req.constraint.kind, req.constraint.param) == ("regex", "guided_regex")
            lengths.append(len(req.constraint.resume))
    return lengths


@pytest.mark.parametrize("handoff", ["one_shot", "catch_up"])
def test_every_tier_resumes_the_constraint_from_the_emitted_tokens(pdd, handoff):
    ids = script(pdd, 60)
    pdd.by_id("rld0").script.step_delay_s = 0.01
    pdd.by_id("md0").kv.land_delay_s = 0.2
    if handoff == "catch_up":
        pdd.by_id("md0").script.first_delay_s = 0.03
    body = complete(pdd, "p_rld_md", handoff, guided_regex="( w[0-9]+)+", max_tokens=64).json()
    assert body["choices"][0]["text"] == pdd.codec.decode(ids[:-1])
    pd = body["pdd"]
    assert pd["handoff"] == handoff and 0 < pd["rld_tokens"] < len(ids) - 1
    lengths = _resumes_match_prompts(pdd, ["p0", "rld0", "md0"], prompt_ids(pdd))
    assert lengths[0] == 0 and lengths[1] == 1  # P from the start, RLD after P's token
    md = [len(r.constraint.resume) for r in pdd.by_id("md0").requests]
    assert md[-1] == 1 + pd["rld_tokens"]  # MD's switch resumes after every RLD token
    if handoff == "catch_up":
        assert len(md) >= 2 and md == sorted(md)  # warm-ups carry it too


def test_a_takeover_resumes_the_constraint(spares):  # noqa: F811 (fixture)
    ids = script(spares, 6)
    for md in ("md0", "md1"):
        spares.by_id(md).script.error_after = 3
    body = complete(spares, "p_md", guided_regex="( w[0-9]+)+").json()
    assert body["choices"][0]["text"] == spares.codec.decode(ids[:-1])
    second = body["pdd"]["md"]
    first = "md1" if second == "md0" else "md0"
    assert list(spares.by_id(first).requests[-1].constraint.resume) == ids[:1]
    assert list(spares.by_id(second).requests[-1].constraint.resume) == ids[:4]
    _resumes_match_prompts(spares, ["p0", "p1", "md0", "md1"], prompt_ids(spares))


def test_a_forced_tool_call_is_constrained_to_its_tools_schemas(router):
    """tool_choice named / required: the Generate carries a ``tool_call`` constraint (one
    alternative per eligible tool: name + arguments key, the parameters' schema, the close)."""
    from tests.router.test_api_tools import CALL, TIME, WEATHER, say

    say(router, CALL[len('<tool_call>\n{"name": "get_weather", "arguments": ') :])
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": named}
    r = httpx.post(router.url + "/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    c = router.fake.requests[-1].constraint
    assert (c.kind, c.param) == ("tool_call", "tools")
    params = WEATHER["function"]["parameters"]
    assert json.loads(c.spec) == [{"prefix": "", "schema": params, "suffix": "}\n</tool_call>"}]
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    router.reset()
    say(router, "x")
    r = httpx.post(router.url + "/chat/completions", timeout=10,
                   json={**body, "tool_choice": "required"})  # fmt: skip
    alts = json.loads(router.fake.requests[-1].constraint.spec)
    assert [a["prefix"] for a in alts] == [
        'get_weather", "arguments": ',
        'get_time", "arguments": ',
    ]
    assert alts[1]["schema"] == {"type": "object"}
    router.reset()
    r = httpx.post(router.url + "/chat/completions", timeout=10,
                   json={**body, "response_format": {"type": "json_object"}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert not router.fake.requests
