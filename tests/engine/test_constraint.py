"""The structured-output logits processor (pdd.engine.constraint) without an engine: xgrammar
and the default model's tokenizer only.

The property that makes a constraint survive every tier change: a processor that gets a
request with ``resume`` = the first k emitted tokens masks exactly as the processor that
emitted them would have, so decoding continues identically whatever k is.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from pdd.config import ModelConfig
from pdd.engine.constraint import (
    EXTRA_KEY,
    ConstraintLogitsProcessor,
    _Compiler,
    check_spec,
    spec_from_extra,
    to_extra,
)
from pdd.engine.model import prepare_model
from pdd.engine.types import ConstraintSpec
from pdd.errors import InvalidRequestError

VOCAB = 49152
EOS = 2
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                "required": ["kind"]},
    },
    "required": ["name", "age", "tags", "pet"],
}  # fmt: skip


@pytest.fixture(scope="module")
def vllm_config():
    path = prepare_model(ModelConfig(dtype="float32"))
    mc = SimpleNamespace(
        tokenizer=str(path), trust_remote_code=False,
        get_vocab_size=lambda: VOCAB, try_get_generation_config=lambda: {"eos_token_id": EOS},
    )  # fmt: skip
    return SimpleNamespace(model_config=mc)


@pytest.fixture(scope="module")
def tokenizer(vllm_config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)


_COMPILERS: dict[int, object] = {}


def _proc(vllm_config) -> ConstraintLogitsProcessor:
    """A processor as vLLM builds one per engine; the tokenizer's compiler (~1 s to build)
    is shared between the tests' processors, as one engine's requests share it."""
    proc = ConstraintLogitsProcessor(vllm_config, torch.device("cpu"), False)
    if id(vllm_config) not in _COMPILERS:
        _COMPILERS[id(vllm_config)] = _Compiler(vllm_config)
    proc._compiler = _COMPILERS[id(vllm_config)]
    return proc


def _params(spec: ConstraintSpec):
    from vllm import SamplingParams

    return SamplingParams(stop_token_ids=[EOS], extra_args={EXTRA_KEY: to_extra(spec)})


def _batch(added=(), removed=(), moved=(), size=1):
    from vllm.v1.sample.logits_processor import BatchUpdate

    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def _logits(step: int, rows: int = 1) -> torch.Tensor:
    """The same pseudo-random logits for a given position, whichever tier computes them."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, VOCAB, generator=g)


def _decode(proc, row: int, output: list[int], start: int, steps: int, rows: int = 1):
    """Greedy under the mask from position ``start``; appends to ``output`` (vLLM's list)."""
    for step in range(start, start + steps):
        out = proc.apply(_logits(step, rows))
        tok = int(out[row].argmax())
        output.append(tok)
        if tok == EOS:
            break


def _one_tier(vllm_config, spec: ConstraintSpec, steps: int) -> list[int]:
    proc = _proc(vllm_config)
    output: list[int] = []
    proc.update_state(_batch(added=[(0, _params(spec), [1, 2, 3], output)]))
    _decode(proc, 0, output, 0, steps)
    return output


@pytest.mark.parametrize("handoff_at", [1, 2, 5, 11, 23])
def test_a_tier_resumed_from_emitted_tokens_decodes_as_one_tier_would(vllm_config, handoff_at):
    """P/RLD emit k tokens, MD continues with resume = those k: the same tokens as one
    engine under the constraint (the oracle of the e2e tests, here with random logits)."""
    spec = ConstraintSpec("json_schema", json.dumps(PERSON))
    whole = _one_tier(vllm_config, spec, 40)
    first = whole[:handoff_at]
    md = _proc(vllm_config)
    output: list[int] = []
    resumed = ConstraintSpec("json_schema", json.dumps(PERSON), resume=tuple(first))
    md.update_state(_batch(added=[(0, _params(resumed), [1, 2, 3, *first], output)]))
    _decode(md, 0, output, handoff_at, 40 - handoff_at)
    assert first + output == whole


def test_without_resume_the_next_tier_would_restart_the_grammar(vllm_config, tokenizer):
    """Why resume is needed: inside a string value a resumed matcher allows the closing
    quote; a fresh one (what vLLM's own structured outputs would build on MD) does not."""

    def allowed(resume: list[int]) -> set[int]:
        proc = _proc(vllm_config)
        spec = ConstraintSpec("json_schema", json.dumps(PERSON), resume=tuple(resume))
        proc.update_state(_batch(added=[(0, _params(spec), [1, *resume], [])]))
        return set(
            torch.isfinite(proc.apply(torch.zeros(1, VOCAB))[0]).nonzero().flatten().tolist()
        )

    quote = tokenizer.encode('"')[0]
    inside = allowed(tokenizer.encode('{"name": "Al'))
    fresh = allowed([])
    assert quote in inside and quote not in fresh
    assert all(tokenizer.decode([t]).strip()[:1] in ("{", "") for t in fresh)


def test_completed_output_parses_and_validates(vllm_config, tokenizer):
    """A greedy run whose logits favour ending (EOS boosted, whitespace-only tokens and long
    strings held back: random logits would wander forever) ends in a JSON that validates."""
    spec = ConstraintSpec("json_schema", json.dumps(PERSON))
    proc = _proc(vllm_config)
    output: list[int] = []
    proc.update_state(_batch(added=[(0, _params(spec), [1], output)]))
    blank = [t for t in range(VOCAB) if t != EOS and not tokenizer.decode([t]).strip()]
    for step in range(200):
        logits = _logits(step)
        logits[0, blank] -= 100.0
        logits[0, EOS] += 50.0  # taken as soon as the grammar allows it
        logits[0, tokenizer.encode('"')[0]] += 5.0  # strings close quickly
        tok = int(proc.apply(logits)[0].argmax())
        output.append(tok)
        if tok == EOS:
            break
    assert output[-1] == EOS, tokenizer.decode(output)
    value = json.loads(tokenizer.decode(output[:-1]))
    jsonschema.validate(value, PERSON)


def test_rows_follow_batch_moves_and_swaps(vllm_config):
    """Two constrained requests and one free one; vLLM moves and swaps rows: each matcher
    stays with its request (the masks follow), the free row is never masked."""
    a = ConstraintSpec("choice", json.dumps(["yes", "no"]), param="guided_choice")
    b = ConstraintSpec("regex", "[0-9]{3}", param="guided_regex")
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import MoveDirectionality

    proc = _proc(vllm_config)
    oa, ob, of = [], [], []
    proc.update_state(_batch(
        added=[(0, _params(a), [1], oa), (1, SamplingParams(), [1], of), (2, _params(b), [1], ob)],
        size=3,
    ))  # fmt: skip
    masked = proc.apply(torch.zeros(3, VOCAB))
    allowed_a = set(torch.isfinite(masked[0]).nonzero().flatten().tolist())
    allowed_b = set(torch.isfinite(masked[2]).nonzero().flatten().tolist())
    assert torch.isfinite(masked[1]).all()
    proc.update_state(_batch(moved=[(0, 2, MoveDirectionality.SWAP)], size=3))
    swapped = proc.apply(torch.zeros(3, VOCAB))
    assert set(torch.isfinite(swapped[2]).nonzero().flatten().tolist()) == allowed_a
    assert set(torch.isfinite(swapped[0]).nonzero().flatten().tolist()) == allowed_b
    proc.update_state(_batch(removed=[1], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)],
                             size=2))  # fmt: skip
    moved = proc.apply(torch.zeros(2, VOCAB))
    assert set(torch.isfinite(moved[1]).nonzero().flatten().tolist()) == allowed_a
    proc.update_state(_batch(removed=[0, 1], size=0))
    assert proc._rows == {}


def test_a_refused_resume_token_ends_the_request(vllm_config, tokenizer):
    """Never expected (every emitted token was sampled under the grammar), but if a resume
    token is refused the row allows only its stop tokens: it ends instead of leaving the
    grammar or failing the batch."""
    bad = ConstraintSpec("regex", "[0-9]+", resume=tuple(tokenizer.encode("abc")))
    proc = _proc(vllm_config)
    proc.update_state(_batch(added=[(0, _params(bad), [1], [])]))
    row = proc.apply(torch.zeros(1, VOCAB))[0]
    assert torch.isfinite(row).nonzero().flatten().tolist() == [EOS]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (ConstraintSpec("json_schema", '{"type": "nope"}'), 'Unsupported type "nope"'),
        (ConstraintSpec("json_schema", '{"type": "number", "multipleOf": 3}'), "does not enforce"),
        (ConstraintSpec("regex", "a(b", param="guided_regex"), "parenthesis is not closed"),
        (ConstraintSpec("grammar", "root ::= foo", param="guided_grammar"), "not defined"),
        (ConstraintSpec("choice", "[]", param="guided_choice"), "invalid choice"),
    ],
)
def test_bad_specs_are_400s_naming_the_parameter(spec, fragment):
    with pytest.raises(InvalidRequestError) as err:
        check_spec(spec, VOCAB)
    assert err.value.param == spec.param
    assert fragment in err.value.message and err.value.message.startswith(spec.param)
    assert "/project/cpp" not in err.value.message


def test_resume_ids_out_of_the_vocabulary_are_refused():
    with pytest.raises(InvalidRequestError, match=r"resume token ids must be in \[0, 49152\)"):
        check_spec(ConstraintSpec("json_object", "", resume=(VOCAB,)), VOCAB)


def test_valid_specs_pass_and_round_trip_through_extra_args():
    lark = 'start: "a" | "b"'
    for spec in (
        ConstraintSpec("json_object", ""),
        ConstraintSpec("json_schema", json.dumps(PERSON), resume=(5, 6)),
        ConstraintSpec("regex", r"\d{4}-\d{2}", param="structured_outputs"),
        ConstraintSpec("choice", '["x", "y"]', param="guided_choice"),
        ConstraintSpec("grammar", 'root ::= "a" | "b"', param="guided_grammar"),
        ConstraintSpec("grammar", lark, param="guided_grammar"),
    ):
        check_spec(spec, VOCAB)
        assert spec_from_extra(_params(spec)) == spec
        ConstraintLogitsProcessor.validate_params(_params(spec))
    with pytest.raises(ValueError, match="must be a constraint of kind"):
        ConstraintLogitsProcessor.validate_params(_params(ConstraintSpec("nope", "(")))
    with pytest.raises(ValueError, match="non-negative resume ids"):
        ConstraintLogitsProcessor.validate_params(_params(ConstraintSpec("regex", "a", (-1,))))


def test_a_spec_that_cannot_be_built_in_the_engine_core_never_raises(vllm_config):
    """Validated before it gets there, but if one did: the step must not raise (that would
    kill the engine for every request); the row allows only its stop tokens."""
    proc = _proc(vllm_config)
    proc.update_state(_batch(added=[(0, _params(ConstraintSpec("regex", "(")), [1], [])]))
    row = proc.apply(torch.zeros(1, VOCAB))[0]
    assert torch.isfinite(row).nonzero().flatten().tolist() == [EOS]


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props)}


S, INT, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
SCHEMA_CASES = [  # (schema, a valid instance): required fields, nesting, enums, arrays
    (_obj({"name": S}), {"name": "Ana"}),
    (_obj({"age": INT}), {"age": 31}),
    (_obj({"x": N, "y": N}), {"x": 1.5, "y": -2}),
    (_obj({"ok": B}), {"ok": True}),
    (_obj({"color": {"enum": ["red", "green"]}}), {"color": "green"}),
    (_obj({"tags": {"type": "array", "items": S}}), {"tags": ["a", "b c"]}),
    (_obj({"ids": {"type": "array", "items": INT, "maxItems": 3}}), {"ids": [1, 2, 3]}),
    (_obj({"p": _obj({"q": S})}), {"p": {"q": "deep"}}),
    (_obj({"a": _obj({"b": _obj({"c": INT})})}), {"a": {"b": {"c": 7}}}),
    (_obj({"items": {"type": "array", "items": _obj({"n": S, "k": INT})}}),
     {"items": [{"n": "x", "k": 1}, {"n": "y", "k": 2}]}),
    (_obj({"name": S, "nick": S}, ["name"]), {"name": "Bo"}),
    (_obj({"name": S, "nick": S}, ["name"]), {"name": "Bo", "nick": "B"}),
    (_obj({"v": {"type": ["string", "null"]}}), {"v": None}),
    (_obj({"v": {"anyOf": [INT, S]}}), {"v": "seven"}),
    (_obj({"when": {"type": "string", "format": "date"}}), {"when": "2026-12-02"}),
    (_obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}), {"code": "CDG"}),
    (_obj({"n": {"type": "integer", "minimum": 1, "maximum": 9}}), {"n": 5}),
    (_obj({"m": {"type": "object", "additionalProperties": INT}}), {"m": {"a": 1, "b": 2}}),
    (_obj({"mode": {"const": "fast"}}), {"mode": "fast"}),
    (_obj({"grid": {"type": "array", "items": {"type": "array", "items": INT}}}),
     {"grid": [[1, 2], [3]]}),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "instance"), SCHEMA_CASES)
def test_twenty_schemas_resume_at_every_token(vllm_config, tokenizer, schema, instance):
    """For each schema and a valid answer, the mask of a matcher resumed after k tokens
    equals the mask the one tier that emitted them holds, at every k; the whole answer is
    accepted and then only the stop token is allowed."""
    jsonschema.validate(instance, schema)
    text = json.dumps(instance)
    ids = tokenizer.encode(text, add_special_tokens=False)
    spec = ConstraintSpec("json_schema", json.dumps(schema))
    one = _proc(vllm_config)
    output: list[int] = []
    one.update_state(_batch(added=[(0, _params(spec), [1], output)]))
    for k in range(len(ids) + 1):
        mask = torch.isfinite(one.apply(torch.zeros(1, VOCAB))[0])
        assert bool(mask[ids[k]]) if k < len(ids) else mask.nonzero().flatten().tolist() == [EOS]
        resumed = _proc(vllm_config)
        rspec = ConstraintSpec("json_schema", json.dumps(schema), resume=tuple(ids[:k]))
        resumed.update_state(_batch(added=[(0, _params(rspec), [1, *ids[:k]], [])]))
        assert torch.equal(torch.isfinite(resumed.apply(torch.zeros(1, VOCAB))[0]), mask), k
        if k < len(ids):
            output.append(ids[k])


def test_an_answer_missing_a_required_field_is_refused(vllm_config, tokenizer):
    schema = _obj({"name": S, "age": INT})
    ids = tokenizer.encode(json.dumps({"name": "Ana"}), add_special_tokens=False)
    proc = _proc(vllm_config)
    output: list[int] = []
    proc.update_state(
        _batch(added=[(0, _params(ConstraintSpec("json_schema", json.dumps(schema))), [1], output)])
    )
    allowed = []
    for t in ids:
        allowed.append(bool(torch.isfinite(proc.apply(torch.zeros(1, VOCAB))[0, t])))
        output.append(t)
    assert allowed[:-1] == [True] * (len(ids) - 1) and allowed[-1] is False  # the closing }


def test_a_forced_tool_call_continues_to_valid_arguments_and_the_close(vllm_config, tokenizer):
    """The ``tool_call`` kind the router sends for tool_choice required: one of the names,
    arguments valid against that tool's schema, the hermes close, then only the stop token."""
    weather = _obj({"city": S})
    alts = [
        {"prefix": 'get_weather", "arguments": ', "schema": weather, "suffix": "}\n</tool_call>"},
        {"prefix": 'get_time", "arguments": ', "schema": {"type": "object"},
         "suffix": "}\n</tool_call>"},
    ]  # fmt: skip
    spec = ConstraintSpec("tool_call", json.dumps(alts), param="tools")
    check_spec(spec, VOCAB)

    def accepts(text: str) -> bool:
        proc = _proc(vllm_config)
        output: list[int] = []
        proc.update_state(_batch(added=[(0, _params(spec), [1], output)]))
        for t in [*tokenizer.encode(text, add_special_tokens=False), EOS]:
            if not bool(torch.isfinite(proc.apply(torch.zeros(1, VOCAB))[0, t])):
                return False
            output.append(t)
        return True

    assert accepts('get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert accepts('get_time", "arguments": {}}\n</tool_call>')
    assert not accepts('get_weather", "arguments": {"town": "Paris"}}\n</tool_call>')
    assert not accepts('get_news", "arguments": {}}\n</tool_call>')
    assert not accepts('get_time", "arguments": {}}\n</tool_call>\n<tool_call>')  # one call
