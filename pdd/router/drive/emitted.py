"""One request's emitted-token stream: the single truth of what the client has seen.

Pure (no I/O). Every tier continues ``prompt + emitted`` (``continuation``) with
``max_tokens`` (and ``min_tokens``) reduced by what was emitted; ``take`` appends a tier's
tokens, cuts anything past ``max_tokens`` and decides whether that tier's finish ends the
request. Nothing else appends, so the stream never repeats or skips a token, and any worker
can continue it after a loss (extend-decode).
"""

from __future__ import annotations

import time
from dataclasses import replace

from pdd.router.record import PddTrace
from pdd.router.types import GenerationRequest, TokenEvent, TokenLogprob


class EmittedStream:
    """The emitted tokens of ``req`` and how each tier continues it; counts into ``trace``."""

    def __init__(self, req: GenerationRequest, trace: PddTrace) -> None:
        self.req = req
        self._trace = trace
        self.emitted: list[int] = []
        self.finish_reason: str | None = None
        self.p_cached_tokens = 0  # P's prefix-cache hit: the request's usage.cached_tokens
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()  # P's, when the request asks
        self._first_taken = False
        self._last_emit_at: float | None = None
        self._switch_from: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.req.sampling.max_tokens - len(self.emitted)

    def continuation(
        self, request_id: str, *, max_tokens: int | None = None, prompt_logprobs: bool = False
    ) -> GenerationRequest:
        """The request a tier runs: ``prompt + emitted``, the budget left (or ``max_tokens``),
        its constraint resumed from ``emitted``, and its penalties counting ``emitted``. The
        request's ``prompt_logprobs`` only with ``prompt_logprobs`` (P's prefill: the one tier
        that computes the whole prompt)."""
        s = self.req.sampling
        budget = self.remaining if max_tokens is None else max_tokens
        min_left = min(budget, max(0, s.min_tokens - len(self.emitted)))
        c = self.req.constraint
        return replace(
            self.req,
            request_id=request_id,
            prompt_token_ids=self.req.prompt_token_ids + tuple(self.emitted),
            # penalties count the emitted tokens as output (pdd.engine.penalties)
            sampling=replace(
                s,
                max_tokens=budget,
                min_tokens=min_left,
                prior_output_tokens=len(self.emitted),
                prompt_logprobs=s.prompt_logprobs if prompt_logprobs else None,
            ),
            # the grammar resumes where the client's text is (pdd.engine.constraint)
            constraint=None if c is None else replace(c, resume=tuple(self.emitted)),
        )

    def take(self, event: TokenEvent, tier: str, *, final: bool) -> TokenEvent:
        """Emit ``event``'s tokens (at most ``remaining``); returns what the client gets.

        ``final``: this tier's finish reason ends the request (P's ``length`` after its one
        token does not). Reaching ``max_tokens`` ends it with ``length`` whatever the tier.
        """
        tokens = event.token_ids[: max(self.remaining, 0)]
        cut = len(tokens) < len(event.token_ids)
        finish = event.finish_reason if final else None
        if cut or (
            finish is None and len(self.emitted) + len(tokens) >= self.req.sampling.max_tokens
        ):
            finish = "length"
        self.emitted.extend(tokens)
        if tokens:
            self._trace.count(tier, len(tokens))
            now = time.monotonic()
            if self._switch_from is not None and tier == "md":
                self._trace.handoff_stall_s = now - self._switch_from
                self._switch_from = None
            self._last_emit_at = now
        self.finish_reason = finish
        first, self._first_taken = not self._first_taken, True
        return replace(
            event,
            token_ids=tokens,
            logprobs=event.logprobs[: len(tokens)],
            finish_reason=finish,
            stop_token_id=None if cut or not final else event.stop_token_id,
            num_cached_tokens=self.p_cached_tokens if first else 0,
            prompt_logprobs=self.prompt_logprobs if first else (),
        )

    def mark_switch(self) -> None:
        """The handoff switch starts now: the next MD tokens end the stall being measured."""
        self._switch_from = self._last_emit_at
