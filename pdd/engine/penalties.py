"""Presence and frequency penalties that count the tokens earlier tiers emitted.

vLLM counts presence and frequency penalties over a request's *output* tokens only. A pdd
tier that continues a request (RLD or MD after P's token, MD after a handoff, a takeover) gets
the tokens already emitted as *prompt* tokens, so on its own it would forget them: the
penalties would restart at every tier change and the text would depend on where the handoff
happened. The router says how many prompt tokens are earlier output
(``SamplingSpec.prior_output_tokens``); ``Engine`` passes that count as
``SamplingParams.extra_args["pdd_prior_output"]`` when a presence or frequency penalty is set,
and this processor adds, per row and step, what vLLM leaves out for those last N prompt
tokens::

    extra[t] = frequency * prior_count[t] + presence * (t in prior and t not in vLLM's output)

so that the sum with vLLM's own penalty is the penalty of one engine that emitted everything.
The repetition penalty already counts them (vLLM applies it to prompt and output tokens alike).

Order: vLLM runs this processor (argmax-changing) *before* its penalties, and its repetition
penalty scales a logit (x / r above 0, x * r otherwise). So for a row with r != 1 the
processor writes the logit that vLLM's scaling turns into ``rep(x) - extra`` (the inverse
scaling), not ``x - extra``. The result equals one engine's to float rounding (the same
terms added in another order). Engine-core process, like ``pdd.engine.constraint``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from pdd.engine.batch_rows import update_rows

if TYPE_CHECKING:
    from vllm.config import VllmConfig

EXTRA_KEY = "pdd_prior_output"  # SamplingParams.extra_args: how many prompt tokens are output
FQCN = "pdd.engine.penalties:PriorOutputPenalties"


def prior_extra(prior_output_tokens: int, presence: float, frequency: float) -> int | None:
    """The ``extra_args`` value for a request (None: nothing to add)."""
    if prior_output_tokens > 0 and (presence or frequency):
        return prior_output_tokens
    return None


@dataclass
class _Row:
    tokens: torch.Tensor  # the distinct prior output tokens (long)
    extra: torch.Tensor  # what to subtract from each (float32): frequency x count + presence
    where: dict[int, int]  # prior token -> its index, while its presence is still ours to add
    presence: float
    repetition: float
    output: list[int]  # vLLM's live output list of the request
    seen: int = 0


class PriorOutputPenalties(LogitsProcessor):
    """Adds the presence / frequency penalty of the earlier tiers' tokens (module doc)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self._device = device
        self._rows: dict[int, _Row] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        raw = (sampling_params.extra_args or {}).get(EXTRA_KEY)
        if raw is not None and (not isinstance(raw, int) or raw < 0):
            raise ValueError(f"{EXTRA_KEY} must be a non-negative token count")

    def is_argmax_invariant(self) -> bool:
        return False  # a penalty changes the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        update_rows(self._rows, batch_update, self._new_row)

    def _new_row(
        self, params: SamplingParams, prompt: list[int] | None, output: list[int]
    ) -> _Row | None:
        n = (params.extra_args or {}).get(EXTRA_KEY)
        if not n or not prompt:
            return None
        counts = Counter(prompt[-n:])
        extra = [params.frequency_penalty * c + params.presence_penalty for c in counts.values()]
        return _Row(
            tokens=torch.tensor(list(counts), dtype=torch.long, device=self._device),
            extra=torch.tensor(extra, dtype=torch.float32, device=self._device),
            where={t: k for k, t in enumerate(counts)},
            presence=params.presence_penalty,
            repetition=params.repetition_penalty,
            output=output,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, row in self._rows.items():
            if i < logits.shape[0]:
                _penalize(logits, i, row)
        return logits


def _penalize(logits: torch.Tensor, i: int, row: _Row) -> None:
    for t in row.output[row.seen :]:  # this tier's new tokens (usually one per step)
        if t < 0:  # an async-scheduling placeholder: read it again next step
            break
        row.seen += 1
        k = row.where.pop(t, None)
        if k is not None:  # vLLM's own presence penalty covers it from now on
            row.extra[k] -= row.presence
    extra = row.extra
    x = logits[i, row.tokens]
    r = row.repetition
    if r == 1.0:
        logits[i, row.tokens] = x - extra
        return
    target = torch.where(x > 0, x * (1.0 / r), x * r) - extra  # what one engine would have
    logits[i, row.tokens] = torch.where(target > 0, target / (1.0 / r), target / r)
