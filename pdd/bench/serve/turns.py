"""The turns workload: the whole stream of a cold prompt and of its next turn, per size.

Per size in ``sizes`` and per round: a new conversation of exactly that many prompt tokens
(cold: it shares only the chat template's opening with anything sent before), then its next
turn (warm): the same messages plus a tool call and its result, ``new_tokens`` more tokens, as
an agent sends. Groups ``cold-N`` then ``warm-N`` per size, each its own phase; every answer runs
``output_tokens`` tokens. One unmeasured cold request of the first size opens the run (a new
system's first request is not what is measured). Run it closed loop at concurrency 1: each
request's times are its own, with no queue in them.
"""

from __future__ import annotations

import random

from pdd.bench.serve.config import TurnsConfig
from pdd.bench.serve.text import Msg, TextGen, fresh, tool_turn, turn_shared
from pdd.bench.serve.tokens import TokenModel
from pdd.bench.serve.workload import BenchRequest, Group, Workload


def cold_name(size: int) -> str:
    return f"cold-{size}"


def warm_name(size: int) -> str:
    return f"warm-{size}"


def generate_turns(cfg: TurnsConfig, tokens: TokenModel, seed: int) -> Workload:
    gen = TextGen(tokens, random.Random(f"turns-text-{seed}"))
    opening = tokens.message_overhead("system")[0]  # common to every chat prompt
    assistant, user = (sum(tokens.message_overhead(r)) for r in ("assistant", "user"))
    requests: list[BenchRequest] = []
    groups: list[Group] = []

    def emit(group: str, conv: str, msgs: list[Msg], total: int, shared: int,
             after: int | None = None, warmup: bool = False) -> int:  # fmt: skip
        index = len(requests)
        requests.append(BenchRequest(
            index=index, group=group, warmup=warmup, conversation=conv,
            max_tokens=cfg.output_tokens, messages=tuple((m.role, m.text) for m in msgs),
            prompt_tokens=total, shared_tokens=shared, after=after,
        ))  # fmt: skip
        return index

    for size in cfg.sizes:
        cold, warm = cold_name(size), warm_name(size)
        groups += [Group(cold), Group(warm)]
        if not requests:
            emit(cold, "opener", fresh(gen, size, size // 4), size, opening, warmup=True)
        turns = []
        for r in range(cfg.rounds):
            msgs = fresh(gen, size, size // 4)
            turns.append((msgs, emit(cold, f"{size}-{r}", msgs, size, opening)))
        for r, (msgs, first) in enumerate(turns):
            nxt = msgs + tool_turn(gen, cfg.new_tokens - assistant - user)
            emit(warm, f"{size}-{r}", nxt, size + cfg.new_tokens, turn_shared(tokens, size),
                 after=first)  # fmt: skip
    return Workload("turns", groups, requests)
