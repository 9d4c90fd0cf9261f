"""PDD and baseline routing policy (pure; see ``routing.choose``).

router.mode pdd, per request (hit = cached prompt tokens / prompt tokens, in [0, 1]):

    P    score(p)  = p_hit(p)  - p_load_weight  * load(p)            (requests in flight)
         p_hit: the router's view of P's prefix cache (the block-hash chains it recently
         sent to that P, an LRU per P: pdd.router.fleet.routed_prefixes). Prefill is serial compute,
         so a queue counts per request: with the default 0.25 a P holding 80% of the prompt
         still wins against an idle cold P until it has 4 more requests queued.
    MD   score(md) = md_hit(md) - md_load_weight * load(md) / max_num_seqs(md)
         md_hit: the router's replica of MD's DRC (pdd.router.fleet.drc_views), or the prefix it
         recently routed to that MD (routed_prefixes), whichever is longer: the replica lags
         by up to one health poll. The WAN estimate below uses the replica only. Decode
         batches, so load counts as a fraction of MD's sequence slots; MDs with no free slot,
         or whose DRC has no room for the blocks they lack, are only used when every MD is
         full. With the default 0.5 a follow-up turn stays on the MD holding its history
         unless that MD is far busier (a 50% hit difference is worth a full MD's load).
    ties (both): least loaded, lower KV usage, fewest requests served so far (idle workers
         take turns), then id: every choice is deterministic for one snapshot.
    RLD  among RLDs with a free sequence slot and room to land the prompt's KV, the most free
         slots (max_num_seqs - load); ties: lower load fraction, fewest served, id.
    room (KV capacity): each worker's Stats report its arena and the blocks a new request can
         have (``kv_free_blocks``; MD: free + evictable DRC blocks + the slots of landings
         kept for a later turn, which give way). P is chosen among the Ps with room for the
         prompt's whole blocks when any has it (else the chosen P's own
         refusal answers: 429 with Retry-After, or 400 when it can never fit); an RLD without
         room is not picked (p_md instead). Between polls the pool takes what it routed off
         each worker's room (``WorkerPool.note_routed``).
    WAN  wan_bytes = (prompt whole blocks - MD's cached blocks) * kv_block_bytes * ratio
         (ratio: P's learned wire/raw ratio of its WAN codec, 1 when raw or unknown)
         eta       = rtt + wan_bytes * 8 / bandwidth      (P's live estimate, else config)
    compute   = fixed + (prompt - MD's cached tokens) / rate   (MD's measured prefill; inf
              when MD reported none, router.pdd.md_recompute is off, MD lacks no block, or
              it lacks more than md_recompute_max_tokens: a cold prompt's prefill on MD
              would stall its decode batch as colocated serving does, so its KV crosses,
              RLD streaming meanwhile when the wait is over the budget; on p_md, with no
              RLD to cover it, the bound gives way when eta is over ttft_budget_s)
    ready     = min(eta, compute): recompute or wait, when MD can start
    p_md      when ready <= ttft_budget_s, or no RLD has a free sequence slot and room (graceful
              degradation: a longer TTFT on MD instead of overloading RLD); MD computes the
              blocks it lacks itself (no KV crosses) when compute < eta, else waits for them
    p_rld_md  otherwise (the WAN carries MD's KV while RLD streams)
    handoff   one_shot when that RLD's load (requests / max_num_seqs) is at or above
              catch_up_load_threshold (free it soonest), else catch_up (p_md: none)

A request may force ``pipeline`` (p_md | p_rld_md) and ``handoff`` (one_shot | catch_up).
There is no P-RLD pipeline: RLD finishing first is an outcome the driver handles, never a
choice. Ending every request on MD keeps MD's DRC as warm as P's prefix cache; the TEST-ONLY
``router.pdd.test_policy: p_rld_only`` breaks exactly that (P -> RLD, RLD emits every token
through the pd driver, MD never sees the request) so tests can show the drift it causes.
Unknown block geometry (no Stats yet) counts as an infinite ETA: p_rld_md if it can.
KV geometry (``pdd.kv_geometry``): P is chosen among the Ps some healthy MD can take KV from,
MD and RLD among the workers that can take P's KV (``view.kv_conflict``); when every MD (or a
forced RLD) differs in a field no receiver converts, the request is refused (503) with a
message naming P, that worker and the field. Never routed between them.

Baselines (the standard PD flow: P prefills, D emits every token, P's token included):
    pd_wan    D = least loaded main_decode in another datacenter than P (else any main_decode)
    pd_local  D = least loaded main_decode in P's datacenter, else relay_decode there
    D's own cache counts, as in vLLM's disaggregated flow, where the decoder pulls only the
    blocks its prefix cache lacks: a main_decode D gets the blocks its DRC lacks and loads the
    rest from it; an RLD (it keeps no prefix across requests) gets every block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

from pdd.config.router import PddPolicyConfig
from pdd.errors import UnavailableError
from pdd.protocol import HandoffMode, Pipeline, Role, RouterMode
from pdd.router.decide.view import (
    Decision,
    FleetView,
    RouteRequest,
    WorkerView,
    kv_conflict,
    least_loaded,
)


@dataclass(frozen=True, slots=True)
class WanEstimate:
    cached_blocks: int
    missing_blocks: int
    wan_bytes: int  # what crosses: raw_bytes x P's codec ratio
    eta_s: float  # math.inf when the block geometry is unknown
    raw_bytes: int = 0


def wan_estimate(
    p: WorkerView, md: WorkerView, cached_tokens: int, prompt_tokens: int, view: FleetView
) -> WanEstimate:
    """Bytes the WAN must carry for this prompt to MD, and how long that takes."""
    block_size = p.block_size or md.block_size
    block_bytes = p.kv_block_bytes or md.kv_block_bytes
    if block_size <= 0 or block_bytes <= 0:
        return WanEstimate(0, 0, 0, math.inf)
    blocks = prompt_tokens // block_size
    cached = min(cached_tokens // block_size, blocks)
    raw_bytes = (blocks - cached) * block_bytes
    ratio = p.wan_wire_ratio if 0 < p.wan_wire_ratio <= 1.0 else 1.0
    wan_bytes = round(raw_bytes * ratio)
    bandwidth, rtt, queued = _link(p, md, view)
    ahead = min(queued, wan_bytes)  # shortest remaining first: what goes before these bytes
    eta = rtt + (ahead + wan_bytes) * 8 / bandwidth
    return WanEstimate(cached, blocks - cached, wan_bytes, eta, raw_bytes)


def _link(p: WorkerView, md: WorkerView, view: FleetView) -> tuple[float, float, int]:
    """(bandwidth bit/s, RTT s, bytes queued) of P's link to ``md``: P's live estimate of
    that link (measured by its warm-up or its transfers), else P's best-measured link, else the
    router's config. Queued: bytes of P's open transfers to ``md`` not yet acknowledged; P's
    sender serves the transfer with the fewest bytes left first, so a new transfer of N bytes
    waits for those below N: the router sees only their sum and counts at most N of it."""
    link = p.link_to(md.id)
    if link is not None and link.bandwidth_bps > 0:
        return (
            link.bandwidth_bps,
            link.rtt_s or p.wan_rtt_s or view.policy.wan_rtt_s,
            link.queued_bytes,
        )
    queued = link.queued_bytes if link is not None else 0
    return (p.wan_bandwidth_bps or view.policy.wan_bandwidth_bps,
            p.wan_rtt_s or view.policy.wan_rtt_s, queued)  # fmt: skip


def md_recompute_s(
    md: WorkerView, tokens: int, policy: PddPolicyConfig, wait_s: float = 0.0
) -> float:
    """How long MD takes to compute ``tokens`` prompt tokens itself, from the prefill rate its
    engine measured at start and keeps live, where the policy lets it; else math.inf (MD
    waits for their KV): md_recompute on, a rate reported, and at most
    md_recompute_max_tokens unless waiting for them (``wait_s``, on p_md: nothing streams
    meanwhile) would miss ttft_budget_s."""
    if not policy.md_recompute or md.prefill_tokens_per_s <= 0:
        return math.inf
    if tokens > policy.md_recompute_max_tokens and wait_s <= policy.ttft_budget_s:
        return math.inf
    return md.prefill_fixed_s + tokens / md.prefill_tokens_per_s


def md_computes_rest_sooner(
    p: WorkerView,
    md: WorkerView,
    cached_tokens: int,
    landed_blocks: int,
    received_bytes: int,
    prompt_tokens: int,
    view: FleetView,
) -> bool:
    """Recompute or wait, again, while MD waits for its KV. P sends MD the prompt's blocks past
    ``cached_tokens``; ``landed_blocks`` of the prompt are loadable on MD now (its cache and
    what landed) and ``received_bytes`` reached it (counted once a transfer ended, before its
    blocks are committed). True when MD computing what has not landed (its live prefill
    rate) is sooner than the bytes still to come crossing at P's live WAN estimate: bytes
    already across never count again. Never without md_recompute, nor for more than
    md_recompute_max_tokens still missing while the rest would cross within ttft_budget_s
    (p_md only: no RLD streams while MD waits)."""
    sent = wan_estimate(p, md, cached_tokens, prompt_tokens, view)
    if sent.missing_blocks == 0:
        return False
    landed_new = max(0, landed_blocks - sent.cached_blocks)
    rest_bytes = sent.wan_bytes - max(received_bytes,
                                      sent.wan_bytes * landed_new // sent.missing_blocks)  # fmt: skip
    if rest_bytes <= 0:
        return False
    bandwidth, rtt, _ = _link(p, md, view)  # its own rest is among the queued bytes
    rest_s = rtt / 2 + rest_bytes * 8 / bandwidth
    landed = max(cached_tokens, landed_blocks * md.block_size)
    return md_recompute_s(md, prompt_tokens - landed, view.policy, rest_s) < rest_s


def _tie(w: WorkerView) -> tuple[int, float, int, str]:
    """The tie-break of both scores (flattened into their keys)."""
    return (w.load, w.kv_cache_usage, w.served, w.id)


def _md_key(
    cached: Mapping[str, int], prompt_tokens: int, weight: float, w: WorkerView
) -> tuple[bool, float, int, float, int, str]:
    """MD's order: full MDs last (no free sequence, or no room in its DRC for the blocks it
    lacks), then -md_score, then the tie-break. The one place the score is computed; choose
    runs it for every MD of every request, so it calls nothing but `load`."""
    load, cap = w.load, w.max_num_seqs
    hit = cached.get(w.id, 0)
    if hit > prompt_tokens:
        hit = prompt_tokens
    frac = hit / prompt_tokens if prompt_tokens else 0.0
    bs = w.block_size
    no_room = w.kv_arena_blocks > 0 and bs > 0 and (prompt_tokens - hit) // bs > w.kv_free_blocks
    return (no_room or (cap > 0 and load >= cap), weight * (load / cap if cap > 0 else 0.0) - frac,
            load, w.kv_cache_usage, w.served, w.id)  # fmt: skip


def _p_key(
    cached: Mapping[str, int], prompt_tokens: int, weight: float, w: WorkerView
) -> tuple[float, int, float, int, str]:
    """P's order: -p_score, then the tie-break (the one place the score is computed)."""
    load = w.load
    hit = cached.get(w.id, 0)
    frac = (hit if hit < prompt_tokens else prompt_tokens) / prompt_tokens if prompt_tokens else 0.0
    return (weight * load - frac, load, w.kv_cache_usage, w.served, w.id)


def md_score(md: WorkerView, cached: Mapping[str, int], prompt_tokens: int, weight: float) -> float:
    """hit fraction in MD's DRC - weight * MD's load fraction (see the module docstring)."""
    return -_md_key(cached, prompt_tokens, weight, md)[1]


def p_score(p: WorkerView, cached: Mapping[str, int], prompt_tokens: int, weight: float) -> float:
    """hit fraction in the view of P's prefix cache - weight * P's requests in flight."""
    return -_p_key(cached, prompt_tokens, weight, p)[0]


def pick_md(
    mds: list[WorkerView],
    cached: Mapping[str, int],
    prompt_tokens: int = 0,
    weight: float = 0.5,
) -> WorkerView | None:
    """Highest MD score among MDs with a free slot (all MDs when none has one)."""
    if not mds:
        return None
    if prompt_tokens <= 0:  # no prompt size: the longest cached prefix, then load
        pool = [w for w in mds if w.has_capacity] or mds
        return min(pool, key=lambda w: (-cached.get(w.id, 0), _tie(w)))
    # the candidate last: a positional partial is the cheapest key call
    return min(mds, key=partial(_md_key, cached, prompt_tokens, weight))


def pick_p(
    ps: list[WorkerView], cached: Mapping[str, int], prompt_tokens: int, weight: float
) -> WorkerView | None:
    """Highest P score (prefix affinity against queue length)."""
    if not ps:
        return None
    return min(ps, key=partial(_p_key, cached, prompt_tokens, weight))


def pick_rld(rlds: list[WorkerView], prompt_tokens: int = 0) -> WorkerView | None:
    """The RLD with the most free sequence slots among those with a free slot and room to land
    the prompt's KV; None when no RLD has both."""
    free = [w for w in rlds if w.has_capacity and w.fits(prompt_tokens)]
    if not free:
        return None
    return min(free, key=lambda w: (-w.free_slots, w.load_fraction, w.served, w.id))


def handoff_mode(rld: WorkerView, view: FleetView, forced: HandoffMode | None) -> HandoffMode:
    """One-Shot frees a busy RLD soonest (one bigger stall on MD); a lightly loaded RLD can
    afford to keep decoding while MD catches up in small, invisible rounds (PDD-FACTS)."""
    if forced is not None:
        return forced
    if rld.load_fraction >= view.policy.catch_up_load_threshold:
        return HandoffMode.ONE_SHOT
    return HandoffMode.CATCH_UP


def choose_pdd(view: FleetView, request: RouteRequest) -> Decision:
    """router.mode pdd: P, MD, maybe RLD, the pipeline and the handoff mode."""
    policy, n = view.policy, request.prompt_tokens
    all_mds = view.healthy(Role.MAIN_DECODE)
    ps = _senders(view.healthy(Role.PREFILL), all_mds)
    ps = [w for w in ps if w.fits(n)] or ps  # none has room now: the chosen P's refusal says so
    p = _need(view, Role.PREFILL, pick_p(ps, request.p_cached_tokens, n, policy.p_load_weight))
    if policy.test_policy == "p_rld_only":
        return _p_rld_only(view, p)
    mds = _receivers(p, all_mds, Role.MAIN_DECODE)
    affinity = _affinity(request.md_cached_tokens, request.md_routed_tokens)
    md = _need(view, Role.MAIN_DECODE, pick_md(mds, affinity, n, policy.md_load_weight))
    cached = min(request.md_cached_tokens.get(md.id, 0), n)
    est = wan_estimate(p, md, cached, n, view)
    missing = n - cached if est.missing_blocks else 0
    ready_s = min(est.eta_s, md_recompute_s(md, missing, policy) if missing else math.inf)
    rld: WorkerView | None = None
    if request.pipeline is Pipeline.P_RLD_MD:
        rlds = _receivers(p, view.healthy(Role.RELAY_DECODE), Role.RELAY_DECODE)
        rld = _need(view, Role.RELAY_DECODE, pick_rld(rlds, n) or least_loaded(rlds))
    elif request.pipeline is None and ready_s > policy.ttft_budget_s:
        rlds = [w for w in view.healthy(Role.RELAY_DECODE) if kv_conflict(p, w) is None]
        rld = pick_rld(rlds, n)  # None: no RLD has a slot and room -> degrade to p_md
    roles = [(Role.PREFILL, p.id)]
    if rld is None:
        pipeline, handoff = Pipeline.P_MD, HandoffMode.NONE
    else:
        pipeline, handoff = Pipeline.P_RLD_MD, handoff_mode(rld, view, request.handoff)
        roles.append((Role.RELAY_DECODE, rld.id))
    roles.append((Role.MAIN_DECODE, md.id))
    block_size = p.block_size or md.block_size
    compute_s = md_recompute_s(md, missing, policy, est.eta_s) if missing else math.inf
    if rld is None and compute_s < est.eta_s:  # MD computes what it lacks: nothing crosses
        return Decision(pipeline, tuple(roles), handoff, cached, 0, compute_s, block_size,
                        md_computes=True)  # fmt: skip
    return Decision(pipeline, tuple(roles), handoff, cached, est.wan_bytes, est.eta_s, block_size)


def _affinity(cached: Mapping[str, int], routed: Mapping[str, int]) -> Mapping[str, int]:
    """Per MD, the longer of its replica's prefix and the prefix recently routed there."""
    if not routed:  # the replica alone (the planner's every request): no merge to build
        return cached
    return {i: max(cached.get(i, 0), routed.get(i, 0)) for i in {*cached, *routed}}


def _p_rld_only(view: FleetView, p: WorkerView) -> Decision:
    """TEST ONLY (router.pdd.test_policy p_rld_only): P -> RLD through the pd driver; RLD
    receives every block and emits every token, MD never sees the request."""
    rlds = view.healthy(Role.RELAY_DECODE)
    rld = _need(view, Role.RELAY_DECODE, pick_rld(rlds) or least_loaded(rlds))
    assignments = ((Role.PREFILL, p.id), (Role.RELAY_DECODE, rld.id))
    return Decision(Pipeline.PD, assignments, block_size=p.block_size or rld.block_size,
                    relay_only=True)  # fmt: skip


def choose_pd(view: FleetView, request: RouteRequest) -> Decision:
    """Baselines pd_wan / pd_local: P and one decoder that receives what its cache lacks."""
    decoders = view.healthy(Role.MAIN_DECODE, Role.RELAY_DECODE)
    p = _need(view, Role.PREFILL, least_loaded(_senders(view.healthy(Role.PREFILL), decoders)))
    mds = [w for w in view.healthy(Role.MAIN_DECODE) if kv_conflict(p, w) is None]
    if view.mode is RouterMode.PD_WAN:
        remote = [w for w in mds if w.datacenter != p.datacenter]
        d = _need(view, Role.MAIN_DECODE, least_loaded(remote or mds))
    else:
        local_md = [w for w in mds if w.datacenter == p.datacenter]
        rlds = [w for w in view.healthy(Role.RELAY_DECODE) if kv_conflict(p, w) is None]
        local_rld = [w for w in rlds if w.datacenter == p.datacenter]
        d = least_loaded(local_md or local_rld)  # type: ignore[assignment]
        if d is None:
            raise UnavailableError(
                f"pd_local: no healthy main_decode or relay_decode worker in P's datacenter "
                f"{p.datacenter!r}; retry later"
            )
    cached = own_cache_tokens(d, request)
    est = wan_estimate(p, d, cached, request.prompt_tokens, view)
    return Decision(
        Pipeline.PD, ((Role.PREFILL, p.id), (d.role, d.id)), HandoffMode.NONE, cached,
        est.wan_bytes, est.eta_s, p.block_size or d.block_size,
    )  # fmt: skip


def own_cache_tokens(d: WorkerView, request: RouteRequest) -> int:
    """The prompt tokens a baseline's D holds in its own prefix cache, as vLLM's decoder
    pulls only the blocks its cache lacks: a main_decode's DRC (the router's replica); an
    RLD keeps no prefix across requests, so it gets every block."""
    if d.role is not Role.MAIN_DECODE:
        return 0
    return min(request.md_cached_tokens.get(d.id, 0), request.prompt_tokens)


def _senders(ps: list[WorkerView], receivers: list[WorkerView]) -> list[WorkerView]:
    """The Ps whose KV at least one of ``receivers`` can take (all of them when none can:
    the receiver choice then says why)."""
    if not receivers:
        return ps
    # a P that reports no geometry conflicts with no one (kv_conflict): no pair to check
    able = [p for p in ps
            if p.geometry is None or any(kv_conflict(p, r) is None for r in receivers)]  # fmt: skip
    return able or ps


def _receivers(p: WorkerView, candidates: list[WorkerView], role: Role) -> list[WorkerView]:
    """The candidates that can take ``p``'s KV. Raises UnavailableError naming both workers
    and the field when there are candidates but none can (never routed between them)."""
    if p.geometry is None:  # conflicts with no one (kv_conflict)
        return list(candidates)
    conflicts = [kv_conflict(p, w) for w in candidates]
    able = [w for w, why in zip(candidates, conflicts, strict=True) if why is None]
    if candidates and not able:
        raise UnavailableError(f"no {role.value} worker can take KV from {p.id}: {conflicts[0]}")
    return able


def _need(view: FleetView, role: Role, worker: WorkerView | None) -> WorkerView:
    if worker is None:
        raise UnavailableError(no_worker_message(view, role))
    return worker


def no_worker_message(view: FleetView, role: Role) -> str:
    total = sum(1 for w in view.workers if w.role is role)
    if total == 0:
        return f"no {role.value} worker is configured"
    return f"no healthy {role.value} worker (0 of {total} healthy); retry later"
