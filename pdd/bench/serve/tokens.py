"""Token arithmetic for synthetic prompts: how many tokens a piece of text and a chat prompt take.

Synthetic text is a concatenation of *atoms*: strings that start with one space and hold no
other whitespace (``" word"``, ``" word."``, ``' {"tool":'``). A byte-level BPE tokenizer with
the GPT-2 pre-tokenizer (the default model's) never merges across such a space, so the tokens
of a text are the tokens of its atoms laid end to end::

    " alpha beta. gamma"  =  " alpha" | " beta." | " gamma"      (3 atoms)
    tokens                =  [ 1 ]    | [ 1, 1 ]  | [ 2 ]          -> 5 tokens, exactly

A chat prompt then takes ``sum(overhead(role) + content) + generation_prompt`` tokens, where the
overheads come from the model's chat template. Two models of this arithmetic:

- ``ModelTokens``: the served model's ``tokenizer.json`` and chat template (exact counts), read
  with the router's ``TextCodec`` (``tokenizers`` + jinja2; no torch).
- ``EstimatedTokens``: no tokenizer available: about 1.3 tokens per English word, a ChatML-like
  template (approximate counts, the same arithmetic).
"""

from __future__ import annotations

import re
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

Message = tuple[str, str]  # (role, content)
_PIECE = re.compile(r"[^\W\d_]+|\d+|[\W_]+")


class TokenModel(ABC):
    """Counts tokens of atoms and chat prompts. Caches per atom; not thread-safe."""

    name: str

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, ...]] = {}

    def atom_ids(self, atom: str) -> tuple[int, ...]:
        """Token ids of one atom (stand-in ids for the estimator)."""
        ids = self._cache.get(atom)
        if ids is None:
            ids = self._cache[atom] = self._encode_atom(atom)
        return ids

    def atom_tokens(self, atom: str) -> int:
        return len(self.atom_ids(atom))

    def text_tokens(self, atoms: Sequence[str]) -> int:
        return sum(self.atom_tokens(a) for a in atoms)

    @abstractmethod
    def _encode_atom(self, atom: str) -> tuple[int, ...]: ...

    @abstractmethod
    def message_overhead(self, role: str) -> tuple[int, int]:
        """Template tokens around one message's content: (before, after)."""

    @property
    @abstractmethod
    def generation_prompt(self) -> int:
        """Tokens the template appends to ask for the assistant's answer."""

    def prompt_tokens(self, messages: Sequence[tuple[str, Sequence[str]]]) -> int:
        """Tokens of a chat prompt given as (role, atoms) pairs, generation prompt included."""
        total = self.generation_prompt
        for role, atoms in messages:
            before, after = self.message_overhead(role)
            total += before + self.text_tokens(atoms) + after
        return total


class EstimatedTokens(TokenModel):
    """About ``tokens_per_word`` tokens per word; a ChatML-like template (3 + 2 per message)."""

    name = "estimate"

    def __init__(self, tokens_per_word: float = 1.3):
        super().__init__()
        if tokens_per_word < 1:
            raise ValueError("tokens_per_word must be at least 1")
        self._extra = tokens_per_word - 1.0

    def _encode_atom(self, atom: str) -> tuple[int, ...]:
        # One token per piece (a run of letters, of digits, or of punctuation), plus one more
        # for a stable-hash-chosen share of atoms, so a plain word averages tokens_per_word.
        body = atom.strip()
        n = len(_PIECE.findall(body)) or 1
        h = zlib.crc32(body.encode()) & 0xFFFF
        n += int(h / 0x10000 < self._extra)
        return tuple(zlib.crc32(f"{body}#{i}".encode()) for i in range(n))

    def message_overhead(self, role: str) -> tuple[int, int]:
        return 3, 2  # "<|im_start|>" role "\n" ... "<|im_end|>" "\n"

    @property
    def generation_prompt(self) -> int:
        return 3


class ModelTokens(TokenModel):
    """Exact counts from the model's tokenizer and chat template (through the router's codec)."""

    name = "model"

    def __init__(self, folder: Path):
        super().__init__()
        from pdd.router.text.tokenizer import TextCodec  # tokenizers + jinja2 only, no torch

        self.codec = TextCodec.from_folder(folder)
        self._overheads: dict[str, tuple[int, int]] = {}
        self._gen = self._measure_generation_prompt()

    def _encode_atom(self, atom: str) -> tuple[int, ...]:
        return tuple(self.codec.encode(atom, add_special_tokens=False))

    def _render(self, messages: list[dict[str, str]], gen: bool) -> list[int]:
        from pdd.router.text.tokenizer import ChatOptions

        text = self.codec.render_chat(messages, options=ChatOptions(add_generation_prompt=gen))
        return self.codec.encode(text, add_special_tokens=False)

    def message_overhead(self, role: str) -> tuple[int, int]:
        cached = self._overheads.get(role)
        if cached is not None:
            return cached
        # Measure against a system message first (templates add a default one otherwise).
        base = [{"role": "system", "content": " x"}]
        if role == "system":
            base = []
        head = self._render(base, False)
        with_x = self._render(base + [{"role": role, "content": " x"}], False)
        with_y = self._render(base + [{"role": role, "content": " y"}], False)
        common = _common_prefix(with_x, with_y)
        before = common - len(head)
        after = len(with_x) - common - self.atom_tokens(" x")
        self._overheads[role] = (before, after)
        return before, after

    def _measure_generation_prompt(self) -> int:
        msgs = [{"role": "system", "content": " x"}]
        return len(self._render(msgs, True)) - len(self._render(msgs, False))

    @property
    def generation_prompt(self) -> int:
        return self._gen

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The token ids the router will compute for this chat prompt (for checks)."""
        return self.codec.encode_chat([{"role": r, "content": c} for r, c in messages])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    return _common_prefix(a, b)


def load_token_model(kind: str, folder: Path | None, tokens_per_word: float) -> TokenModel:
    """``model``: the tokenizer in ``folder`` (error if missing); ``estimate``: the estimator;
    ``auto``: the model's tokenizer when ``folder`` holds one, else the estimator."""
    if kind == "estimate":
        return EstimatedTokens(tokens_per_word)
    has_tokenizer = folder is not None and (Path(folder) / "tokenizer.json").is_file()
    if kind == "auto" and not has_tokenizer:
        return EstimatedTokens(tokens_per_word)
    if folder is None:
        from pdd.errors import ConfigError

        raise ConfigError("tokenizer=model needs a model folder")
    return ModelTokens(Path(folder))
