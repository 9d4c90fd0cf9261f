"""The agentic workload: conversations that grow by tool-call turns, with a skewed hit rate.

Each measured request draws a target prefix-hit rate ``h`` from ``hit_classes`` and is built
to get it, from the conversations sent so far:

- append: a live conversation of ``n`` tokens gets one more turn (a tool call and its result)
  so the new prompt has ``n / h`` tokens: an ideal cache hits the whole previous prompt.
- branch: when the grown prompt would not fit ``prompt_tokens_max`` (or for anomalies), a new
  conversation of random length ``L`` starts from the first ``h * L`` tokens of an earlier
  prompt (an agent retrying or spawning a sub-task), or from nothing when ``h * L`` is tiny.
- anomalies: a long prompt (near ``prompt_tokens_max``) with a low hit and a very short answer.

Warm-up: one request per live conversation, opening it. Every request names the request that
sent its prefix (``after``), so the runner keeps turns in order.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pdd.bench.serve.config import AgenticConfig, HitClass
from pdd.bench.serve.text import (
    Msg,
    TextGen,
    branch,
    branch_room,
    find_cut,
    fresh,
    tool_turn,
    turn_shared,
)
from pdd.bench.serve.tokens import TokenModel
from pdd.bench.serve.workload import BenchRequest, Group, Workload

GROUP = "agentic"


@dataclass
class _Conv:
    cid: str
    msgs: list[Msg]
    states: list[tuple[int, int, int]]  # (request index, messages, prompt tokens) per request

    @property
    def tokens(self) -> int:
        return self.states[-1][2]


class _Agentic:
    """Builds the request list; all randomness comes from two seeded RNGs."""

    def __init__(self, cfg: AgenticConfig, tokens: TokenModel, seed: int):
        self.cfg = cfg
        self.tokens = tokens
        self.rng = random.Random(f"agentic-decisions-{seed}")
        self.gen = TextGen(tokens, random.Random(f"agentic-text-{seed}"))
        self.pool: list[_Conv] = []
        self.history: list[_Conv] = []
        self.requests: list[BenchRequest] = []

    def run(self) -> Workload:
        cfg = self.cfg
        for _ in range(cfg.conversations):
            length = self.rng.randint(
                cfg.prompt_tokens_min, (cfg.prompt_tokens_min + cfg.prompt_tokens_max) // 2
            )
            self.pool.append(self._fresh(length, self._output(), warmup=True))
        for _ in range(cfg.requests):
            self._measured()
        return Workload("agentic", [Group(GROUP)], self.requests)

    # --- one measured request ---------------------------------------------------------------

    def _measured(self) -> None:
        cfg = self.cfg
        if self.rng.random() < cfg.anomaly_share:
            low = min(cfg.hit_classes, key=lambda c: c.low)
            length = self.rng.randint(
                max(cfg.prompt_tokens_min, int(0.8 * cfg.prompt_tokens_max)), cfg.prompt_tokens_max
            )
            slot = self.rng.randrange(len(self.pool))
            self.pool[slot] = self._branch(
                self._draw(low), length, cfg.anomaly_output_tokens, anomaly=True
            )
            return
        hit = self._draw(self._pick_class())
        out = self._output()
        slot = self.rng.randrange(len(self.pool))
        if hit > 0 and self._append(self.pool[slot], hit, out):
            return
        length = self.rng.randint(cfg.prompt_tokens_min, cfg.prompt_tokens_max)
        self.pool[slot] = self._branch(hit, length, out, anomaly=False)

    def _pick_class(self) -> HitClass:
        classes = self.cfg.hit_classes
        return self.rng.choices(classes, weights=[c.weight for c in classes])[0]

    def _draw(self, cls: HitClass) -> float:
        return self.rng.uniform(cls.low, cls.high)

    def _output(self) -> int:
        lo, hi = self.cfg.output_tokens_min, self.cfg.output_tokens_max
        return max(lo, min(hi, round(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))))

    # --- request builders -------------------------------------------------------------------

    def _append(self, conv: _Conv, hit: float, out: int) -> bool:
        """Grow ``conv`` by one turn to about ``tokens / hit``; False when it would not fit."""
        tk = self.tokens
        assistant, user = sum(tk.message_overhead("assistant")), sum(tk.message_overhead("user"))
        before = conv.tokens
        length = max(math.ceil(before / hit), before + assistant + user + 2)
        if length > self.cfg.prompt_tokens_max:
            return False
        conv.msgs += tool_turn(self.gen, length - before - assistant - user)
        self._emit(conv, length, out, turn_shared(tk, before), after=conv.states[-1][0],
                   warmup=False)  # fmt: skip
        return True

    def _fresh(self, length: int, out: int, warmup: bool, anomaly: bool = False) -> _Conv:
        system = self.rng.randint(length // 8, length // 3)
        conv = _Conv(f"c{len(self.history)}", fresh(self.gen, length, system), [])
        self.history.append(conv)
        opening = self.tokens.message_overhead("system")[0]  # common to every chat prompt
        self._emit(conv, length, out, opening, after=None, warmup=warmup, anomaly=anomaly)
        return conv

    def _branch(self, hit: float, length: int, out: int, anomaly: bool) -> _Conv:
        """A new conversation sharing about ``hit * length`` leading tokens with an earlier one."""
        tk = self.tokens
        target = min(round(hit * length), length - branch_room(tk))
        if target <= tk.message_overhead("system")[0]:
            return self._fresh(length, out, warmup=False, anomaly=anomaly)
        eligible = [c for c in self.history if c.tokens >= target]
        source = (
            self.rng.choice(eligible) if eligible else max(self.history, key=lambda c: c.tokens)
        )
        cut = find_cut(tk, source.msgs, target)
        msgs = branch(self.gen, source.msgs, cut, length)
        after = next(s[0] for s in source.states if s[1] > cut.message)
        conv = _Conv(f"c{len(self.history)}", msgs, [])
        self.history.append(conv)
        self._emit(conv, length, out, cut.shared, after=after, warmup=False, anomaly=anomaly)
        return conv

    def _emit(
        self,
        conv: _Conv,
        length: int,
        out: int,
        shared: int,
        *,
        after: int | None,
        warmup: bool,
        anomaly: bool = False,
    ) -> None:
        index = len(self.requests)
        conv.states.append((index, len(conv.msgs), length))
        self.requests.append(
            BenchRequest(
                index=index,
                group=GROUP,
                warmup=warmup,
                conversation=conv.cid,
                max_tokens=out,
                messages=tuple((m.role, m.text) for m in conv.msgs),
                prompt_tokens=length,
                shared_tokens=shared,
                after=after,
                anomaly=anomaly,
            )
        )


def generate_agentic(cfg: AgenticConfig, tokens: TokenModel, seed: int) -> Workload:
    """The agentic workload for ``cfg`` (same seed and tokenizer: same requests)."""
    return _Agentic(cfg, tokens, seed).run()
