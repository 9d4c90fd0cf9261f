"""Request validation: every range check answers 400 with the offending param."""

from __future__ import annotations

import pytest

from pdd.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError
from pdd.router.http.schemas import ChatCompletionRequest, CompletionRequest
from pdd.router.http.validation import (
    ServingLimits,
    build_chat_request,
    build_completion_request,
    chat_messages,
    check_model,
    check_token_ids,
    choice_requests,
    completion_prompt,
)
from pdd.router.types import SamplingSpec, TextOptions

LIMITS = ServingLimits(("m", "/models/m"), max_model_len=100, vocab_size=1000)
MSG = [{"role": "user", "content": "hi"}]


def chat(prompt_len: int = 10, **body):
    req = ChatCompletionRequest.model_validate({"messages": MSG, **body})
    return build_chat_request(req, list(range(prompt_len)), LIMITS, request_id="r", arrival=1.0)


def completion(prompt_len: int = 10, **body):
    req = CompletionRequest.model_validate({"prompt": "x", **body})
    return build_completion_request(
        req, list(range(prompt_len)), LIMITS, request_id="r", arrival=1.0, decode=_decode
    )


def _decode(ids) -> str:
    return "|".join(map(str, ids))


def test_defaults_fill_every_field():
    req = chat(10)
    assert req.sampling == SamplingSpec(max_tokens=90)  # max_model_len - prompt tokens
    assert req.text == TextOptions()
    assert req.prompt_token_ids == tuple(range(10))


def test_all_fields_map_to_the_spec():
    req = chat(
        10, temperature=0.5, top_p=0.9, top_k=0, max_completion_tokens=20, max_tokens=5,
        min_tokens=2, stop=["a", "a", "b"], stop_token_ids=[7, 7], seed=-3, logprobs=True,
        top_logprobs=3, presence_penalty=1.5, frequency_penalty=-2, repetition_penalty=1.1,
        ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False,
    )  # fmt: skip
    assert req.sampling == SamplingSpec(
        max_tokens=20, temperature=0.5, top_p=0.9, top_k=-1, min_tokens=2, stop_token_ids=(7,),
        seed=-3, logprobs=3, presence_penalty=1.5, frequency_penalty=-2.0,
        repetition_penalty=1.1, ignore_eos=True,
    )  # fmt: skip
    assert req.text == TextOptions(("a", "b"), True, False)
    assert completion(logprobs=0).sampling.logprobs == 0
    assert chat(logprobs=True).sampling.logprobs == 0
    assert completion(stop="\n").text.stop == ("\n",)


def test_logit_bias_min_p_and_allowed_token_ids_map_to_the_spec():
    req = completion(logit_bias={"7": -100, "3": 2.5}, min_p=0.05, allowed_token_ids=[9, 3, 9])
    s = req.sampling
    assert (s.logit_bias, s.min_p, s.allowed_token_ids) == (((3, 2.5), (7, -100.0)), 0.05, (9, 3))
    assert (chat().sampling.logit_bias, chat().sampling.allowed_token_ids) == ((), ())


def test_truncate_prompt_tokens_keeps_the_prompts_end():
    req = completion(prompt_len=30, truncate_prompt_tokens=8)
    assert req.prompt_token_ids == tuple(range(22, 30))
    assert req.sampling.max_tokens == 100 - 8  # the context left after the kept tokens
    # -1: as much as the context holds (vLLM's): which leaves no room for a completion
    with pytest.raises(ContextLengthError):
        completion(prompt_len=150, truncate_prompt_tokens=-1)
    assert chat(prompt_len=150, truncate_prompt_tokens=60).prompt_token_ids[0] == 90


def test_generation_config_defaults_apply_only_when_omitted():
    limits = ServingLimits(("m",), 100, 1000, {"temperature": 0.3, "top_k": 20})
    body = ChatCompletionRequest.model_validate({"messages": MSG})
    req = build_chat_request(body, [1], limits, request_id="r", arrival=0)
    assert (req.sampling.temperature, req.sampling.top_k) == (0.3, 20)
    body = ChatCompletionRequest.model_validate({"messages": MSG, "temperature": 1.0})
    assert (
        build_chat_request(body, [1], limits, request_id="r", arrival=0).sampling.temperature == 1.0
    )


BAD = [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"seed": 2**63}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1000": 1}}, "logit_bias"),  # past the vocabulary
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, 1000]}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 101}, "truncate_prompt_tokens"),  # past max_model_len
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_chat_parameters_are_400_with_param(body, param):
    with pytest.raises(InvalidRequestError) as info:
        chat(**body)
    assert info.value.status_code == 400
    assert info.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [({"logprobs": 21}, "logprobs"), ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"),
     ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
     ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
     ({"max_tokens": 0}, "max_tokens")],
)  # fmt: skip
def test_bad_completion_parameters(body, param):
    with pytest.raises(InvalidRequestError) as info:
        completion(**body)
    assert info.value.param == param


def test_echo_shows_the_prompt_as_given_with_its_logprobs():
    req = completion(10, echo=True, logprobs=2)
    assert (req.text.echo, req.text.echo_only, req.sampling.prompt_logprobs) == ("x", False, 2)
    # vLLM: echo with max_tokens 0 generates one token and shows only the prompt
    only = completion(10, echo=True, max_tokens=0)
    assert (only.text.echo_only, only.sampling.max_tokens, only.sampling.prompt_logprobs) == (
        True, 1, None,
    )  # fmt: skip
    # a truncated prompt (or one of token ids) echoes what was served, decoded
    assert completion(10, echo=True, truncate_prompt_tokens=3).text.echo == "7|8|9"
    ids = CompletionRequest.model_validate({"prompt": [5, 6], "echo": True})
    req = build_completion_request(ids, [5, 6], LIMITS, request_id="r", arrival=1.0, decode=_decode)
    assert req.text.echo == "5|6"
    # an explicit prompt_logprobs wins; without echo, prompt_logprobs alone asks for them
    assert completion(10, echo=True, logprobs=1, prompt_logprobs=3).sampling.prompt_logprobs == 3
    assert completion(10, prompt_logprobs=0).sampling.prompt_logprobs == 0
    assert completion(10, logprobs=1).sampling.prompt_logprobs is None
    assert chat(10, prompt_logprobs=2).sampling.prompt_logprobs == 2


def test_several_choices_are_requests_of_their_own():
    req = completion(10, seed=5)
    assert choice_requests(req, 1, admits=1) == [req]
    reqs = choice_requests(req, 3, admits=8)
    assert [(r.request_id, r.sampling.seed) for r in reqs] == [("r-0", 5), ("r-1", 6), ("r-2", 7)]
    assert [r.sampling.seed for r in choice_requests(completion(10), 2, admits=8)] == [None, None]
    with pytest.raises(InvalidRequestError) as info:  # could never be admitted together
        choice_requests(req, 9, admits=8)
    assert info.value.param == "n" and "router.max_queued_requests 8" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        choice_requests(completion(10, seed=2**63 - 2), 3, admits=8)
    assert info.value.param == "seed"


def test_context_length_errors_name_the_numbers():
    with pytest.raises(ContextLengthError) as info:
        chat(60, max_tokens=50)
    assert info.value.message == (
        "This model's maximum context length is 100 tokens. However, you requested 110 tokens "
        "(60 in the messages, 50 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    assert (info.value.status_code, info.value.code, info.value.param) == (
        400, "context_length_exceeded", "max_tokens",
    )  # fmt: skip
    with pytest.raises(ContextLengthError) as info:
        completion(100)
    assert "your prompt has 100 tokens" in info.value.message
    assert chat(60, max_tokens=40).sampling.max_tokens == 40
    assert completion(99).sampling.max_tokens == 1


def test_model_check_accepts_name_and_path():
    check_model(None, LIMITS)
    check_model("m", LIMITS)
    check_model("/models/m", LIMITS)
    with pytest.raises(ModelNotFoundError) as info:
        check_model("gpt-4", LIMITS)
    assert info.value.status_code == 404
    assert info.value.message == "The model `gpt-4` does not exist. This server serves `m`."


def test_prompt_forms():
    def prompt(p):
        return completion_prompt(CompletionRequest.model_validate({"prompt": p}))

    assert prompt("text") == "text"
    assert prompt(["text"]) == "text"
    assert prompt([1, 2]) == [1, 2]
    assert prompt([[1, 2]]) == [1, 2]
    for bad in (["a", "b"], [[1], [2]], "", []):
        with pytest.raises(InvalidRequestError) as info:
            prompt(bad)
        assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        check_token_ids([1, 1000], LIMITS, "prompt")
    assert info.value.message == "token id 1000 is out of range [0, 1000)"


def test_chat_messages_flatten_text_parts():
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]},
                      {"role": "assistant", "content": None, "name": "bot"}]}
    )  # fmt: skip
    assert chat_messages(body.messages) == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]
    image = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    with pytest.raises(InvalidRequestError):
        chat_messages(image.messages)
    with pytest.raises(InvalidRequestError):
        chat_messages([])
