"""The prompts a receiving worker keeps for later calls' ``prompt_ref`` (pdd.worker.prompt_book),
and the Generate message the router builds with a reference."""

from __future__ import annotations

from pdd.router.fleet.workers import request_to_proto
from pdd.router.types import GenerationRequest, PromptRef, SamplingSpec, TextOptions
from pdd.worker.prompt_book import PromptBook


def test_a_reference_rebuilds_the_prompt_followed_by_what_was_sent():
    book = PromptBook()
    assert book.put("r1", [1, 2, 3, 4])
    assert book.resolve("r1", 4, [9, 8]) == [1, 2, 3, 4, 9, 8]
    assert book.resolve("r1", 2, []) == [1, 2]


def test_an_unknown_id_or_more_tokens_than_kept_resolve_to_none():
    book = PromptBook()
    book.put("r1", [1, 2, 3])
    assert book.resolve("other", 3, []) is None
    assert book.resolve("r1", 4, []) is None
    assert book.resolve("r1", -1, []) is None


def test_the_oldest_prompts_go_first_when_the_budget_is_exceeded():
    book = PromptBook(budget_tokens=10)
    book.put("a", range(4))
    book.put("b", range(4))
    assert book.resolve("a", 4, []) is not None  # a use makes "a" the newest
    book.put("c", range(4))  # 12 > 10: the oldest, "b", goes
    assert book.resolve("b", 4, []) is None
    assert book.resolve("a", 4, []) == [0, 1, 2, 3] and book.resolve("c", 1, []) == [0]
    assert (len(book), book.held_tokens) == (2, 8)


def test_a_prompt_larger_than_the_budget_is_not_kept_and_a_new_one_replaces_the_old():
    book = PromptBook(budget_tokens=3)
    assert not book.put("big", [1, 2, 3, 4])
    assert book.resolve("big", 1, []) is None and book.held_tokens == 0
    book.put("r", [1, 2])
    book.put("r", [5])
    assert book.resolve("r", 1, []) == [5] and book.held_tokens == 1


def test_the_router_sends_only_the_tokens_after_the_reference():
    req = GenerationRequest(
        request_id="x", prompt_token_ids=(1, 2, 3, 4, 5), sampling=SamplingSpec(max_tokens=4),
        text=TextOptions(), arrival=0.0,
    )  # fmt: skip
    whole = request_to_proto(req)
    assert list(whole.prompt_token_ids) == [1, 2, 3, 4, 5] and not whole.HasField("prompt_ref")
    ref = request_to_proto(req, prompt_ref=PromptRef("kv-x", 3))
    assert list(ref.prompt_token_ids) == [4, 5]
    assert (ref.prompt_ref.kv_request_id, ref.prompt_ref.tokens) == ("kv-x", 3)
