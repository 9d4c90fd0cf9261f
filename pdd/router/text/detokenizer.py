"""Incremental detokenization that never emits half a character.

Byte-level tokenizers split one character into several tokens (an emoji is often 2-4 byte
tokens). Decoding a prefix of those tokens ends in U+FFFD; the text is held until the bytes
complete. Two offsets into the token list bound the work per step:

    ids:  [ ... prompt tail ... | emitted ............ | new tokens ]
                                ^ prefix_offset        ^ read_offset

    prefix_text = decode(ids[prefix_offset:read_offset])   (already emitted)
    full_text   = decode(ids[prefix_offset:])
    delta       = full_text[len(prefix_text):]             only when full_text does not end in
                                                           U+FFFD; then both offsets move on.

Decoding from ``prefix_offset`` rather than from ``read_offset`` keeps the context that some
decoders need (leading-space handling, merges across the boundary). The window starts a few
prompt tokens back for the same reason. One instance per request; not thread-safe.

Why not ``tokenizers``' own ``DecodeStream`` (tokenizers 0.23, what vLLM 0.32 and its transformers allow):
its ``step(tokenizer, id)`` takes one id at a time and starts from nothing, with no way to
seed it with the prompt's tail (the context above; an event from a worker carries several
ids), and it needs a ``tokenizers.Tokenizer`` where this class takes any decode function (the
tests' toy codec included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context before the first generated token.
PROMPT_CONTEXT_TOKENS = 5

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas. See the module docstring for the scheme."""

    def __init__(self, decode: Decode, prompt_token_ids: Sequence[int] = ()):
        self._decode = decode
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def held_tokens(self) -> int:
        """Tokens pushed whose text has not been returned yet (an incomplete character)."""
        return len(self._ids) - self._read_offset

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now complete (may be "")."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of generation: return held text even if it ends in U+FFFD."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        if len(full_text) <= len(prefix_text):
            return ""
        return full_text[len(prefix_text) :]
