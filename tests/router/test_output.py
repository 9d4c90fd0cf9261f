"""Token events -> text deltas: stop strings, stop tokens, logprob alignment, usage."""

from __future__ import annotations

from pdd.router.text.output import OutputProcessor
from pdd.router.types import (
    GenerationRequest,
    OutputDelta,
    SamplingSpec,
    TextOptions,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from tests.router.toy_codec import EOS, ToyCodec, toy_encode

PROMPT = tuple(toy_encode("Q: "))


def processor(stop=(), include=False, logprobs=None, skip_special=True) -> OutputProcessor:
    req = GenerationRequest(
        "r", PROMPT, SamplingSpec(max_tokens=100, logprobs=logprobs),
        TextOptions(tuple(stop), include, skip_special), arrival=0.0,
    )  # fmt: skip
    return OutputProcessor(ToyCodec(), req)  # type: ignore[arg-type]


def ev(text="", ids=None, finish=None, stop_token=None, cached=0):
    ids = toy_encode(text) if ids is None else ids
    return TokenEvent(tuple(ids), (), finish, 0, cached, stop_token)


def test_text_flows_and_eos_adds_no_text():
    p = processor()
    assert p.process(ev("ab")) == OutputDelta("ab", tuple(toy_encode("ab")))
    final = p.process(ev(ids=[EOS], finish="stop", stop_token=EOS, cached=2))
    assert final == OutputDelta("", (EOS,), finish_reason="stop", usage=Usage(3, 3, 2))
    assert p.finished and p.completion_tokens == 3


def test_partial_character_waits_and_tokens_wait_with_it():
    p = processor()
    e = toy_encode("é")
    assert p.process(ev(ids=e[:1])) is None  # nothing to show: the token waits for its text
    assert p.process(ev(ids=e[1:])) == OutputDelta("é", tuple(e))


def test_stop_string_truncates_and_counts_consumed_tokens_only():
    p = processor(stop=["STOP"])
    assert p.process(ev("hello S")) == OutputDelta("hello ", tuple(toy_encode("hello ")))
    d = p.process(ev("TOP and the rest"))
    # Generation stops at the token that completed "STOP"; later tokens are not consumed.
    assert d == OutputDelta("", tuple(toy_encode("STOP")), finish_reason="stop",
                            usage=Usage(3, 10, 0))  # fmt: skip
    assert p.completion_tokens == len("hello STOP")


def test_stop_string_included_when_asked():
    p = processor(stop=["STOP"], include=True)
    d = p.process(ev("xSTOPy"))
    assert (d.text, d.finish_reason) == ("xSTOP", "stop")


def test_held_partial_stop_is_released_at_length_finish():
    p = processor(stop=["STOP"])
    assert p.process(ev("go ST")) == OutputDelta("go ", tuple(toy_encode("go ")))
    d = p.process(ev("", ids=[], finish="length"))
    assert (d.text, d.token_ids, d.finish_reason) == ("ST", tuple(toy_encode("ST")), "length")


def test_stop_token_text_shown_only_with_include_and_no_skip():
    p = processor(include=True, skip_special=False)
    d = p.process(ev(ids=[ord("a"), EOS], finish="stop", stop_token=EOS))
    assert d.text == "a<eos>"


def test_logprobs_carry_token_text_bytes_and_offsets():
    p = processor(logprobs=1)
    e = toy_encode("aé")
    lps = tuple(TokenLogprob(t, -1.0 * (i + 1)) for i, t in enumerate(e))
    d = p.process(TokenEvent(tuple(e), lps, "length"))
    assert [(x.token, x.token_bytes, x.logprob, x.text_offset) for x in d.logprobs] == [
        ("a", b"a", -1.0, 0),
        ("bytes:\\xc3", b"\xc3", -2.0, 1),
        ("bytes:\\xa9", b"\xa9", -3.0, 1),
    ]
    assert d.text == "aé"


def test_echo_and_prompt_logprobs_open_the_first_delta_only():
    """``echo``: the prompt's text before the completion's, its logprob entries first (the
    first token has none), the completion's offsets counted in the whole text;
    ``prompt_logprobs``: the prompt's tokens after the first, on the first delta."""
    spec = SamplingSpec(max_tokens=100, logprobs=0, prompt_logprobs=0)
    req = GenerationRequest("r", PROMPT, spec, TextOptions(echo="Q: "), arrival=0.0)
    p = OutputProcessor(ToyCodec(), req)  # type: ignore[arg-type]
    a, b = toy_encode("ab")
    prompt_lps = tuple(TokenLogprob(t, -2.0, rank=3) for t in PROMPT[1:])
    first = p.process(TokenEvent((a,), (TokenLogprob(a, -1.0),), prompt_logprobs=prompt_lps))
    assert first is not None and first.text == "Q: a"
    assert [(x.token, x.logprob, x.text_offset) for x in first.logprobs] == [
        ("Q", None, 0), (":", -2.0, 1), (" ", -2.0, 2), ("a", -1.0, 3),
    ]  # fmt: skip
    assert first.prompt_logprobs is not None
    assert [(x.token_id, x.logprob, x.rank) for x in first.prompt_logprobs] == [
        (t, -2.0, 3) for t in PROMPT[1:]
    ]
    last = p.process(TokenEvent((b,), (TokenLogprob(b, -1.5),), "length"))
    assert last is not None and last.text == "b" and last.prompt_logprobs is None
    assert [(x.token, x.text_offset) for x in last.logprobs] == [("b", 4)]


def test_echo_only_shows_the_prompt_and_counts_the_token():
    """``echo`` with ``max_tokens`` 0 (vLLM): the one generated token is not shown."""
    spec = SamplingSpec(max_tokens=1, logprobs=0, prompt_logprobs=0)
    req = GenerationRequest("r", PROMPT, spec, TextOptions(echo="Q: ", echo_only=True), arrival=0.0)
    p = OutputProcessor(ToyCodec(), req)  # type: ignore[arg-type]
    a = toy_encode("a")[0]
    prompt_lps = tuple(TokenLogprob(t, -2.0) for t in PROMPT[1:])
    d = p.process(TokenEvent((a,), (TokenLogprob(a, -1.0),), "length", prompt_logprobs=prompt_lps))
    assert d is not None and d.text == "Q: "
    assert [x.token for x in d.logprobs] == ["Q", ":", " "]
    assert d.usage == Usage(len(PROMPT), 1, 0)
