"""Synthetic text with exact token counts, and the prompt surgery workloads are built from.

``TextGen`` writes atoms (see ``tokens``) drawn from ``words.WORDS`` with a seeded RNG: plain
prose for user turns and tool results, tool-call-like JSON for assistant turns. ``branch`` makes
a prompt that shares exactly a given number of leading tokens with an earlier one::

    earlier   [system: a b c d e] [user: f g h]           <- cut at "c": shared = open(system)+3
    branched  [system: a b c X Y] [user: P Q R S]         <- X's first token differs from d's

Messages here are ``Msg``: a role and a list of atoms (the text is ``"".join(atoms)``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pdd.bench.serve.tokens import TokenModel
from pdd.bench.serve.words import TOOLS, WORDS


@dataclass
class Msg:
    role: str
    atoms: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.atoms)


class TextGen:
    """Seeded generator of atoms that add up to an exact number of tokens."""

    def __init__(self, tokens: TokenModel, rng: random.Random):
        self.tokens = tokens
        self.rng = rng
        self._ones = [a for a in (" " + w for w in WORDS) if tokens.atom_tokens(a) == 1]
        if not self._ones:
            raise ValueError("the tokenizer has no one-token word in the word list")

    def _atom(self) -> str:
        word = self.rng.choice(WORDS)
        roll = self.rng.random()
        return " " + word + ("." if roll < 0.08 else "," if roll < 0.12 else "")

    def fill(self, n: int, avoid_first: int | None = None) -> list[str]:
        """Atoms with exactly ``n`` tokens; the first token is not ``avoid_first``."""
        if n < 0:
            raise ValueError(f"cannot write {n} tokens")
        out: list[str] = []
        left = n
        while left > 0:
            atom = self._atom()
            size = self.tokens.atom_tokens(atom)
            if size > left:
                atom, size = self.rng.choice(self._ones), 1
            if not out and avoid_first is not None and self.tokens.atom_ids(atom)[0] == avoid_first:
                continue
            out.append(atom)
            left -= size
        return out

    def tool_call(self, n: int) -> list[str]:
        """An assistant turn that looks like a tool call, exactly ``n`` tokens (n >= 1)."""
        head = [' {"tool":', f' "{self.rng.choice(TOOLS)}",', ' "args":', ' {"query":']
        tail = [' "}}']
        fixed = self.tokens.text_tokens(head) + self.tokens.text_tokens(tail)
        if n < fixed + 1:
            return self.fill(n)
        return head + self.fill(n - fixed) + tail

    def tool_result(self, n: int) -> list[str]:
        """A user turn carrying a tool's output, exactly ``n`` tokens (n >= 1)."""
        head = [" [tool", f" {self.rng.choice(TOOLS)}", " result]"]
        fixed = self.tokens.text_tokens(head)
        if n < fixed + 1:
            return self.fill(n)
        return head + self.fill(n - fixed)


def prompt_tokens(tokens: TokenModel, msgs: list[Msg]) -> int:
    return tokens.prompt_tokens([(m.role, m.atoms) for m in msgs])


def fresh(gen: TextGen, total: int, system_tokens: int) -> list[Msg]:
    """A new conversation of exactly ``total`` prompt tokens: a system and a user message."""
    tk = gen.tokens
    fixed = tk.generation_prompt + sum(sum(tk.message_overhead(r)) for r in ("system", "user"))
    system_tokens = max(1, min(system_tokens, total - fixed - 1))
    user_tokens = total - fixed - system_tokens
    if user_tokens < 1:
        raise ValueError(f"a prompt of {total} tokens is too short for a conversation")
    return [Msg("system", gen.fill(system_tokens)), Msg("user", gen.fill(user_tokens))]


def tool_turn(gen: TextGen, content: int) -> list[Msg]:
    """The two messages an agent's next turn adds: its tool call and the tool's result,
    ``content`` tokens of content between them (message overheads not included)."""
    call = max(1, min(64, content // 4))
    return [Msg("assistant", gen.tool_call(call)), Msg("user", gen.tool_result(content - call))]


def turn_shared(tokens: TokenModel, before: int) -> int:
    """Leading tokens a next turn shares with the ``before``-token prompt it extends: that
    prompt ended with the answer cue, which is the new assistant turn's opening."""
    cue = min(tokens.generation_prompt, tokens.message_overhead("assistant")[0])
    return before - tokens.generation_prompt + cue


@dataclass(frozen=True)
class Cut:
    """Where a prompt is cut: message index, atoms kept, and the tokens before the cut."""

    message: int
    atoms: int
    shared: int


def find_cut(tokens: TokenModel, msgs: list[Msg], target: int) -> Cut:
    """The last atom boundary at or before ``target`` tokens (never before a message opening:
    a branch in the same role shares that opening anyway)."""
    pos = 0
    for i, m in enumerate(msgs):
        before, after = tokens.message_overhead(m.role)
        content = tokens.text_tokens(m.atoms)
        if target < pos + before + content + after or i == len(msgs) - 1:
            shared = pos + before
            kept = 0
            for atom in m.atoms:
                size = tokens.atom_tokens(atom)
                if shared + size > target:
                    break
                shared += size
                kept += 1
            return Cut(i, kept, shared)
        pos += before + content + after
    raise ValueError("cannot cut an empty prompt")


def branch(gen: TextGen, msgs: list[Msg], cut: Cut, total: int) -> list[Msg]:
    """A prompt of exactly ``total`` tokens sharing ``cut.shared`` leading tokens with ``msgs``.

    The cut message is continued with new atoms; a user message follows unless the cut message
    is itself a user message. Raises ValueError when ``total`` leaves no room after the cut.
    """
    tk = gen.tokens
    src = msgs[cut.message]
    _, after = tk.message_overhead(src.role)
    user_before, user_after = tk.message_overhead("user")
    budget = total - cut.shared - after - tk.generation_prompt
    nxt = src.atoms[cut.atoms] if cut.atoms < len(src.atoms) else None
    avoid = tk.atom_ids(nxt)[0] if nxt is not None else None
    out = [Msg(m.role, list(m.atoms)) for m in msgs[: cut.message]]
    if src.role == "user":
        if budget < 1:
            raise ValueError(f"no room for a branch of {total} tokens after {cut.shared}")
        out.append(Msg("user", src.atoms[: cut.atoms] + gen.fill(budget, avoid)))
        return out
    budget -= user_before + user_after
    if budget < 2:
        raise ValueError(f"no room for a branch of {total} tokens after {cut.shared}")
    rest_of_src = tk.text_tokens(src.atoms[cut.atoms :])
    own = max(1, min(rest_of_src, budget - 1))
    out.append(Msg(src.role, src.atoms[: cut.atoms] + gen.fill(own, avoid)))
    out.append(Msg("user", gen.fill(budget - own)))
    return out


def branch_room(tokens: TokenModel) -> int:
    """Tokens a branch needs after a cut target, at most: a cut may land up to one message
    opening past its target, then come a closing, a user message and the answer cue."""
    before, after = tokens.message_overhead("user")
    overheads = [tokens.message_overhead(r) for r in ("system", "user", "assistant")]
    worst = max(o[0] for o in overheads) + max(o[1] for o in overheads)
    return worst + before + after + tokens.generation_prompt + 2
