"""Token events -> text deltas for one request.

Per token: incremental detokenization (never half a character), then the stop-string matcher
(never text that may belong to a stop string). A token is released to the client together
with the text it produced, so logprobs and text stay aligned:

    token       t0    t1     t2      t3
    piece       "a"   " S"   "T"     "OP"      (stop="STOP")
    emitted     "a"   " "    ""      stop -> finish "stop", t0..t3 counted, text "a "

A final stop token (EOS or a ``stop_token_ids`` entry) adds no text unless
``include_stop_str_in_output`` (vLLM's rule). The first delta also carries the request's head:
the echoed prompt (``TextOptions.echo``, before the completion's text, with the prompt's
logprobs before the completion's) and the prompt logprobs (``prompt_logprobs``, from the first
event). One instance per request; not thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.router.text.detokenizer import IncrementalDetokenizer
from pdd.router.text.stops import StopStep, StopStringMatcher
from pdd.router.text.tokenizer import TextCodec
from pdd.router.types import (
    GenerationRequest,
    LogprobText,
    OutputDelta,
    TokenEvent,
    TokenLogprob,
    TopText,
    Usage,
)

MISSING_LOGPROB = -9999.0  # OpenAI's stand-in for "no value"; also the floor for -inf


@dataclass(slots=True)
class _Pending:
    token_id: int
    logprob: TokenLogprob | None
    start: int  # offset of this token's text in the completion text (before stop truncation)
    end: int


class OutputProcessor:
    """Feed ``TokenEvent``s in order; get ``OutputDelta``s. ``finished`` once a finish is seen."""

    def __init__(self, codec: TextCodec, req: GenerationRequest):
        self._codec = codec
        self._req = req
        skip = req.text.skip_special_tokens
        self._detok = IncrementalDetokenizer(
            lambda ids: codec.decode(ids, skip_special_tokens=skip), req.prompt_token_ids
        )
        self._stops = StopStringMatcher(
            req.text.stop, include_in_output=req.text.include_stop_str_in_output
        )
        self._pending: list[_Pending] = []
        self._produced = 0  # characters the detokenizer produced so far
        self._emitted = 0  # characters released to the client so far
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self._head_sent = False  # the first delta (echo, prompt logprobs) went out
        self._prompt_logprobs: tuple[LogprobText, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, event: TokenEvent) -> OutputDelta | None:
        """Consume one event. Returns None when there is nothing to show yet."""
        if self.finished:
            raise RuntimeError("process() after the request finished")
        self.cached_tokens = max(self.cached_tokens, event.num_cached_tokens)
        if event.prompt_logprobs and not self._head_sent:
            self._prompt_logprobs = self._prompt_texts(event.prompt_logprobs)
        text = []
        last = len(event.token_ids) - 1
        for i, token_id in enumerate(event.token_ids):
            logprob = event.logprobs[i] if i < len(event.logprobs) else None
            is_stop_token = i == last and event.stop_token_id is not None
            step = self._push(token_id, logprob, is_stop_token)
            text.append(step.text)
            if step.stopped:
                self.finish_reason = "stop"
                return self._delta("".join(text), release_all=True)
        if event.finish_reason is not None:
            step = self._stops.feed(self._detok.flush())
            text.append(step.text)
            if not step.stopped:
                text.append(self._stops.flush())
            self.finish_reason = "stop" if step.stopped else event.finish_reason
            return self._delta("".join(text), release_all=True)
        out = "".join(text)
        head = not self._head_sent and (self._req.text.echo is not None or self._prompt_logprobs)
        return self._delta(out, release_all=False) if out or head or self._releasable() else None

    def _push(self, token_id: int, logprob: TokenLogprob | None, is_stop_token: bool) -> StopStep:
        self.completion_tokens += 1
        if is_stop_token and not self._req.text.include_stop_str_in_output:
            piece = ""
        else:
            piece = self._detok.push([token_id])
        start = self._produced
        self._produced += len(piece)
        self._pending.append(_Pending(token_id, logprob, start, self._produced))
        step = self._stops.feed(piece)
        self._emitted += len(step.text)
        return step

    def _releasable(self) -> int:
        """Pending tokens whose text is out: not held by the detokenizer or the stop matcher."""
        limit = len(self._pending) - self._detok.held_tokens
        n = 0
        while n < limit and self._pending[n].end <= self._emitted:
            n += 1
        return n

    def _delta(self, text: str, *, release_all: bool) -> OutputDelta:
        n = len(self._pending) if release_all else self._releasable()
        released, self._pending = self._pending[:n], self._pending[n:]
        usage = None
        if self.finished:
            usage = Usage(
                len(self._req.prompt_token_ids), self.completion_tokens, self.cached_tokens
            )
        logprobs = self._logprob_texts(released)
        echo, prompt_logprobs = self._req.text.echo, None
        if self._req.text.echo_only:
            text, logprobs = "", ()
        if not self._head_sent:
            self._head_sent = True
            if self._req.sampling.prompt_logprobs is not None:
                prompt_logprobs = self._prompt_logprobs
            if echo is not None:
                text = echo + text
                if self._req.sampling.logprobs is not None:
                    logprobs = self._echoed_logprobs() + logprobs
        return OutputDelta(
            text=text,
            token_ids=tuple(p.token_id for p in released),
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            usage=usage,
            prompt_logprobs=prompt_logprobs,
        )

    def _logprob_texts(self, released: list[_Pending]) -> tuple[LogprobText, ...]:
        if self._req.sampling.logprobs is None or self._req.text.echo_only:
            return ()
        shift = len(self._req.text.echo or "")  # offsets in the response's text
        return tuple(
            self._logprob_text(
                p.logprob or TokenLogprob(p.token_id, MISSING_LOGPROB), p.start + shift
            )
            for p in released
        )

    def _logprob_text(self, lp: TokenLogprob, offset: int) -> LogprobText:
        codec = self._codec
        top = tuple(
            TopText(codec.token_text(t.token_id), codec.token_bytes(t.token_id), t.logprob, t.token_id)
            for t in lp.top
        )  # fmt: skip
        return LogprobText(
            token=codec.token_text(lp.token_id), token_bytes=codec.token_bytes(lp.token_id),
            logprob=lp.logprob, text_offset=offset, top=top, token_id=lp.token_id, rank=lp.rank,
        )  # fmt: skip

    def _prompt_texts(self, entries: tuple[TokenLogprob, ...]) -> tuple[LogprobText, ...]:
        """The prompt's tokens after the first with their logprobs; each offset is where the
        token starts in the prompt's text, counted token by token as vLLM counts it."""
        first = self._req.prompt_token_ids[0]
        offset, out = len(self._codec.token_text(first)), []
        for lp in entries:
            out.append(self._logprob_text(lp, offset))
            offset += len(out[-1].token)
        return tuple(out)

    def _echoed_logprobs(self) -> tuple[LogprobText, ...]:
        """The echoed prompt's logprob entries: its first token has none (nothing precedes it)."""
        first = self._req.prompt_token_ids[0]
        head = LogprobText(
            token=self._codec.token_text(first), token_bytes=self._codec.token_bytes(first),
            logprob=None, text_offset=0, token_id=first,
        )  # fmt: skip
        return (head, *self._prompt_logprobs)
