"""Incremental detokenization never emits a broken character and loses nothing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdd.router.text.detokenizer import IncrementalDetokenizer
from tests.router.toy_codec import EOS, ToyCodec, toy_encode

TOY = ToyCodec()


def toy_detok(prompt: str = "") -> IncrementalDetokenizer:
    return IncrementalDetokenizer(TOY.decode, toy_encode(prompt))


def test_multibyte_character_is_held_until_complete():
    d = toy_detok("hi ")
    emoji = toy_encode("😀")  # 4 bytes: f0 9f 98 80
    assert [d.push([b]) for b in emoji] == ["", "", "", "😀"]
    assert d.push(toy_encode("x")) == "x"


def test_cjk_and_ascii_sequence_exact_deltas():
    d = toy_detok()
    deltas = [d.push([b]) for b in toy_encode("a世b")]
    assert deltas == ["a", "", "", "世", "b"]


def test_skipped_special_token_adds_no_text():
    d = toy_detok("q")
    assert d.push(toy_encode("ok")) == "ok"
    assert d.push([EOS]) == ""
    assert d.flush() == ""


def test_flush_releases_a_truncated_character_as_replacement():
    d = toy_detok()
    assert d.push(toy_encode("é")[:1]) == ""
    assert d.flush() == "\ufffd"
    assert d.flush() == ""


def test_prompt_text_is_never_emitted():
    d = toy_detok("prompt with é")
    assert d.push(toy_encode("!")) == "!"


@given(st.text(min_size=0, max_size=40), st.lists(st.integers(1, 5), max_size=40))
def test_any_chunking_reproduces_the_full_decode(text: str, cuts: list[int]):
    ids = toy_encode(text)
    d = toy_detok("ctx")
    out, i = [], 0
    for n in cuts + [len(ids)]:
        piece = d.push(ids[i : i + n])
        assert "\ufffd" not in piece
        out.append(piece)
        i += n
        if i >= len(ids):
            break
    out.append(d.flush())
    assert "".join(out) == text


def test_real_tokenizer_emoji_and_cjk_byte_tokens(codec):
    text = "Hello 😀 世界! naïve 🚀🚀 end"
    ids = codec.encode(text, add_special_tokens=False)
    # The model's byte-level BPE splits these characters across tokens.
    assert sum("\ufffd" in codec.decode([t]) for t in ids) == 13
    d = IncrementalDetokenizer(codec.decode, codec.encode("Prompt:", add_special_tokens=False))
    pieces = [d.push([t]) for t in ids] + [d.flush()]
    assert pieces == [
        "Hello", "", " 😀", " ", "", "世", "", "", "界", "!", " na", "ïve",
        "", "", " 🚀", "", "", "🚀", " end", "",
    ]  # fmt: skip
    assert "".join(pieces) == text
