"""The hit-rate sweep: the bathtub curve's x axis, in fixed buckets.

Per bucket ``h`` and per measured request, a warm-up request W of ``prompt_tokens`` tokens is
sent first (it fills the cache), then the measured request R, which shares exactly
``K = round(h * prompt_tokens)`` leading tokens with W and then diverges::

    W   [sys open][system content ....][close][user open][user content ..........][cue]
    R   [sys open][system content ....][close][user open][user content ..][new .......][cue]
                                                                          ^ K

Exact in K except where K falls inside template tokens (a handful of values): K moves to the
nearest content boundary. ``h = 0`` gives an unrelated prompt (sharing only the chat template's
opening, as every chat prompt does); ``h = 1`` repeats W.
Each bucket is its own group, so its goodput is measured over its own phase.
"""

from __future__ import annotations

import random

from pdd.bench.serve.config import SweepConfig
from pdd.bench.serve.text import Cut, Msg, TextGen, branch
from pdd.bench.serve.tokens import TokenModel
from pdd.bench.serve.workload import BenchRequest, Group, Workload


def bucket_name(hit: float) -> str:
    return f"hit={hit:g}"


def _layout(tk: TokenModel, total: int) -> tuple[int, int, int]:
    """(system content, start of user content, last K with room to diverge)."""
    s_open, s_close = tk.message_overhead("system")
    u_open, u_close = tk.message_overhead("user")
    system = max(1, total // 8)
    user_start = s_open + system + s_close + u_open
    user = total - user_start - u_close - tk.generation_prompt
    if user < 2:
        raise ValueError(f"sweep.prompt_tokens={total} is too short")
    return system, user_start, total - u_close - tk.generation_prompt - 1


def plan_cut(tk: TokenModel, total: int, hit: float) -> tuple[int, str]:
    """The shared-prefix length actually built for ``hit`` and where it falls:
    ``none`` (unrelated prompt), ``all`` (identical prompt), ``system`` or ``user`` content."""
    s_open = tk.message_overhead("system")[0]
    system, user_start, last = _layout(tk, total)
    k = round(hit * total)
    if k >= total:
        return total, "all"
    if k <= s_open:
        return 0, "none"
    if k <= s_open + system:
        return k, "system"
    if k < user_start:  # inside template tokens: go to the nearer content boundary
        k = s_open + system if k - (s_open + system) <= user_start - k else user_start
        return k, "system" if k == s_open + system else "user"
    return min(k, last), "user"


def _pair(gen: TextGen, total: int, hit: float) -> tuple[list[Msg], list[Msg], int]:
    """(W, R, shared tokens) for one measured request of bucket ``hit``."""
    tk = gen.tokens
    s_open = tk.message_overhead("system")[0]
    system, user_start, _ = _layout(tk, total)
    user = total - user_start - tk.message_overhead("user")[1] - tk.generation_prompt
    k, where = plan_cut(tk, total, hit)
    head_sys = k - s_open if where == "system" else system
    head_user = k - user_start if where == "user" else user
    sys_a, sys_b = gen.fill(head_sys), gen.fill(system - head_sys)
    user_a, user_b = gen.fill(head_user), gen.fill(user - head_user)
    warm = [Msg("system", sys_a + sys_b), Msg("user", user_a + user_b)]
    if where == "all":
        return warm, warm, total
    if where == "none":  # only the template's opening is common, as with any chat prompt
        return warm, [Msg("system", gen.fill(system)), Msg("user", gen.fill(user))], s_open
    cut = Cut(0, len(sys_a), k) if where == "system" else Cut(1, len(user_a), k)
    return warm, branch(gen, warm, cut, total), k


def generate_sweep(cfg: SweepConfig, tokens: TokenModel, seed: int) -> Workload:
    """One group per bucket: W_1, R_1, W_2, R_2, ... (W warm-up, R measured after W)."""
    gen = TextGen(tokens, random.Random(f"sweep-text-{seed}"))
    groups = [Group(bucket_name(h), hit=h) for h in cfg.buckets]
    requests: list[BenchRequest] = []
    for group in groups:
        assert group.hit is not None
        for k in range(cfg.requests_per_bucket):
            warm, measured, shared = _pair(gen, cfg.prompt_tokens, group.hit)
            for msgs, is_warm in ((warm, True), (measured, False)):
                index = len(requests)
                requests.append(
                    BenchRequest(
                        index=index,
                        group=group.name,
                        warmup=is_warm,
                        conversation=f"{group.name}/{k}",
                        max_tokens=cfg.output_tokens,
                        messages=tuple((m.role, m.text) for m in msgs),
                        prompt_tokens=cfg.prompt_tokens,
                        shared_tokens=tokens.message_overhead("system")[0] if is_warm else shared,
                        after=None if is_warm else index - 1,
                    )
                )
    return Workload("sweep", groups, requests)
