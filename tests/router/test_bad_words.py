"""vLLM's ``bad_words``: the router tokenizes them exactly as vLLM's own ``SamplingParams``
does (each word as given and, where it is another token sequence of the same length, with a
leading space), so every tier bans the same token sequences one vLLM engine would; a word of
no tokens, or too many, is a 400 naming ``bad_words``; the API carries them to the worker."""

from __future__ import annotations

import pytest

from pdd.config import ModelConfig
from pdd.errors import InvalidRequestError
from pdd.router.http.request_fields import MAX_BAD_WORDS, bad_words
from pdd.router.text.tokenizer import TextCodec

WORDS = ["Eiffel", "  Paris", "red", "naïve", "日本", "New York", "<|im_end|>", "x"]


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_folder(ModelConfig().resolved_path())


def test_words_tokenize_as_vllm_tokenizes_them(codec):
    from vllm import SamplingParams  # the router never imports vLLM; the test may
    from vllm.tokenizers import get_tokenizer

    params = SamplingParams(bad_words=WORDS)
    params.update_from_tokenizer(get_tokenizer(str(ModelConfig().resolved_path())))
    assert [list(w) for w in bad_words(WORDS, codec)] == params.bad_words_token_ids
    assert any(len(w) > 1 for w in bad_words(WORDS, codec))  # some words span tokens


def test_a_word_of_no_tokens_or_too_many_words_is_a_400(codec):
    for words in ([""], ["   "], [f"w{i}" for i in range(MAX_BAD_WORDS)]):
        with pytest.raises(InvalidRequestError) as info:
            bad_words(words, codec)
        assert info.value.param == "bad_words"
