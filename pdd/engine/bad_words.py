"""vLLM's ``bad_words`` that count the tokens earlier tiers emitted.

vLLM bans a bad word's last token when the request's *output* ends with the word's other
tokens. A pdd tier that continues a request gets the tokens already emitted as *prompt*
tokens, so vLLM's own check would miss a word whose first tokens an earlier tier emitted. The
router tokenizes the words as vLLM does (``pdd.router.http.request_fields.bad_words``) and
``Engine`` passes them, with how many prompt tokens are earlier output
(``SamplingSpec.prior_output_tokens``), as ``SamplingParams.extra_args["pdd_bad_words"]``; this processor bans, per row and step, the
last token of every word whose other tokens end ``prior + output``: one engine's answer,
whichever tier emitted what. Engine-core process, like ``pdd.engine.penalties``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from pdd.engine.batch_rows import update_rows

if TYPE_CHECKING:
    from vllm.config import VllmConfig

EXTRA_KEY = "pdd_bad_words"  # SamplingParams.extra_args: {"words": [[ids]], "prior": n}
FQCN = "pdd.engine.bad_words:BadWords"


def extra(words: tuple[tuple[int, ...], ...], prior_output_tokens: int) -> dict[str, Any] | None:
    """The ``extra_args`` value for a request (None: no bad words)."""
    if not words:
        return None
    return {"words": [list(w) for w in words], "prior": prior_output_tokens}


@dataclass
class _Row:
    words: list[list[int]]
    prior: list[int]  # the prompt's last tokens that are earlier tiers' output
    output: list[int]  # vLLM's live output list of the request
    longest: int  # the longest word's length

    def banned(self) -> list[int]:
        n = self.longest - 1  # only the last n tokens can begin a word: never copy the output
        past = (self.prior[-n:] + self.output[-n:])[-n:] if n > 0 else []
        out = []
        for word in self.words:
            k = len(word) - 1
            if k == 0 or (len(past) >= k and past[len(past) - k :] == word[:k]):
                out.append(word[-1])
        return out


class BadWords(LogitsProcessor):
    """Bans bad words' last tokens over earlier tiers' output too (module doc)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self._rows: dict[int, _Row] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        raw = (sampling_params.extra_args or {}).get(EXTRA_KEY)
        if raw is None:
            return
        words, prior = raw.get("words"), raw.get("prior")
        if not isinstance(prior, int) or prior < 0 or not isinstance(words, list):
            raise ValueError(f"{EXTRA_KEY} must be {{'words': [[ids]], 'prior': n >= 0}}")
        if not all(isinstance(w, list) and w and all(t >= 0 for t in w) for w in words):
            raise ValueError(f"{EXTRA_KEY}: each word is a non-empty list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False  # a ban changes the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        update_rows(self._rows, batch_update, self._new_row)

    @staticmethod
    def _new_row(
        params: SamplingParams, prompt: list[int] | None, output: list[int]
    ) -> _Row | None:
        raw = (params.extra_args or {}).get(EXTRA_KEY)
        if not raw:
            return None
        n = raw["prior"]
        prior = list(prompt[-n:]) if n and prompt else []
        words = raw["words"]
        return _Row(words, prior, output, max(len(w) for w in words))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, row in self._rows.items():
            if i < logits.shape[0]:
                banned = row.banned()
                if banned:
                    logits[i, banned] = float("-inf")
        return logits
