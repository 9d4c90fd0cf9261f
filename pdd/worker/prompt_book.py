"""The prompts a receiving worker got in PrepareKv, so that later calls of the same request
refer to them instead of resending them (``GenerateRequest.prompt_ref``).

A request's prompt crosses the WAN to MD once: in PrepareKv. MD's Generate, each Catch-Up
warm-up, the switch and a takeover send only what follows it (RLD's tokens) with a reference
``(kv_request_id, tokens)``. The book is a cache, not a promise: it keeps the newest prompts up
to a token budget and drops the oldest first, and a reference it cannot resolve is refused
before anything starts, so the router resends that call's prompt whole (``PromptRefMissing``).

    book.put(kv_id, prompt)
    book.resolve(kv_id, tokens, rest)  # the whole prompt, or None
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_BUDGET_TOKENS = 8_000_000  # 32 MB of int32 token ids


class PromptBook:
    """Prompts by KV request id, newest last, at most ``budget_tokens`` token ids held."""

    def __init__(self, budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> None:
        self._budget = budget_tokens
        self._held = 0
        self._prompts: OrderedDict[str, array] = OrderedDict()

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def held_tokens(self) -> int:
        return self._held

    def put(self, kv_request_id: str, prompt: Sequence[int]) -> bool:
        """Keep ``prompt`` under ``kv_request_id``; False when it is larger than the whole
        budget (not kept)."""
        self._drop(kv_request_id)
        if len(prompt) > self._budget:
            return False
        self._prompts[kv_request_id] = array("i", prompt)
        self._held += len(prompt)
        while self._held > self._budget:
            _, old = self._prompts.popitem(last=False)
            self._held -= len(old)
        return True

    def resolve(self, kv_request_id: str, tokens: int, rest: Sequence[int]) -> list[int] | None:
        """The first ``tokens`` of the kept prompt followed by ``rest``; None when the prompt is
        not kept or is shorter than ``tokens``. A use makes it the newest."""
        kept = self._prompts.get(kv_request_id)
        if kept is None or not 0 <= tokens <= len(kept):
            return None
        self._prompts.move_to_end(kv_request_id)
        return kept[:tokens].tolist() + list(rest)

    def _drop(self, kv_request_id: str) -> None:
        old = self._prompts.pop(kv_request_id, None)
        if old is not None:
            self._held -= len(old)
