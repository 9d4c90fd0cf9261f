"""PDD and baseline routing policy (pure; see ``routing.choose``).

router.mode pdd, per request:

    P    least loaded prefill worker
    MD   the main-decode worker whose DRC holds the longest prompt prefix, then least loaded
    WAN  wan_bytes = (prompt whole blocks - MD's cached blocks) * kv_block_bytes
         eta       = rtt + wan_bytes * 8 / bandwidth      (P's live estimate, else config)
    p_md      when eta <= ttft_budget_s, or no RLD has a free sequence slot
    p_rld_md  otherwise, with the least loaded RLD that has capacity
    handoff   catch_up when that RLD's load (requests / max_num_seqs) is above
              catch_up_load_threshold, else one_shot (p_md: none)

A request may force ``pipeline`` (p_md | p_rld_md) and ``handoff`` (one_shot | catch_up).
There is no P-RLD pipeline: RLD finishing first is an outcome the driver handles, never a
choice. Unknown block geometry (no Stats yet) counts as an infinite ETA: p_rld_md if it can.

Baselines (P sends every block to D, D emits every token):
    pd_wan    D = least loaded main_decode in another datacenter than P (else any main_decode)
    pd_local  D = least loaded main_decode in P's datacenter, else relay_decode there
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pdd.errors import UnavailableError
from pdd.protocol import HandoffMode, Pipeline, Role, RouterMode
from pdd.router.fleet import Decision, FleetView, RouteRequest, WorkerView, least_loaded


@dataclass(frozen=True, slots=True)
class WanEstimate:
    cached_blocks: int
    missing_blocks: int
    wan_bytes: int
    eta_s: float  # math.inf when the block geometry is unknown


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
    wan_bytes = (blocks - cached) * block_bytes
    bandwidth = p.wan_bandwidth_bps or view.policy.wan_bandwidth_bps
    rtt = p.wan_rtt_s or view.policy.wan_rtt_s
    return WanEstimate(cached, blocks - cached, wan_bytes, rtt + wan_bytes * 8 / bandwidth)


def pick_md(mds: list[WorkerView], cached: Mapping[str, int]) -> WorkerView | None:
    """Longest cached prefix first, then least loaded, then KV usage, then id."""
    if not mds:
        return None
    return min(mds, key=lambda w: (-cached.get(w.id, 0), w.load, w.kv_cache_usage, w.id))


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
    p = _need(view, Role.PREFILL, least_loaded(view.healthy(Role.PREFILL)))
    mds = view.healthy(Role.MAIN_DECODE)
    md = _need(view, Role.MAIN_DECODE, pick_md(mds, request.md_cached_tokens))
    cached = min(request.md_cached_tokens.get(md.id, 0), request.prompt_tokens)
    est = wan_estimate(p, md, cached, request.prompt_tokens, view)
    rlds = view.healthy(Role.RELAY_DECODE)
    rld: WorkerView | None = None
    if request.pipeline is Pipeline.P_RLD_MD:
        rld = _need(view, Role.RELAY_DECODE, least_loaded(rlds))
    elif request.pipeline is None and est.eta_s > view.policy.ttft_budget_s:
        rld = least_loaded([w for w in rlds if w.has_capacity])
    roles = [(Role.PREFILL, p.id)]
    if rld is None:
        pipeline, handoff = Pipeline.P_MD, HandoffMode.NONE
    else:
        pipeline, handoff = Pipeline.P_RLD_MD, handoff_mode(rld, view, request.handoff)
        roles.append((Role.RELAY_DECODE, rld.id))
    roles.append((Role.MAIN_DECODE, md.id))
    block_size = p.block_size or md.block_size
    return Decision(pipeline, tuple(roles), handoff, cached, est.wan_bytes, est.eta_s, block_size)


def choose_pd(view: FleetView, request: RouteRequest) -> Decision:
    """Baselines pd_wan / pd_local: P and one decoder that receives every block."""
    p = _need(view, Role.PREFILL, least_loaded(view.healthy(Role.PREFILL)))
    mds = view.healthy(Role.MAIN_DECODE)
    if view.mode is RouterMode.PD_WAN:
        remote = [w for w in mds if w.datacenter != p.datacenter]
        d = _need(view, Role.MAIN_DECODE, least_loaded(remote or mds))
    else:
        local_md = [w for w in mds if w.datacenter == p.datacenter]
        rlds = view.healthy(Role.RELAY_DECODE)
        local_rld = [w for w in rlds if w.datacenter == p.datacenter]
        d = least_loaded(local_md or local_rld)  # type: ignore[assignment]
        if d is None:
            raise UnavailableError(
                f"pd_local: no healthy main_decode or relay_decode worker in P's datacenter "
                f"{p.datacenter!r}; retry later"
            )
    est = wan_estimate(p, d, 0, request.prompt_tokens, view)
    return Decision(
        Pipeline.PD, ((Role.PREFILL, p.id), (d.role, d.id)), HandoffMode.NONE, 0,
        est.wan_bytes, est.eta_s, p.block_size or d.block_size,
    )  # fmt: skip


def _need(view: FleetView, role: Role, worker: WorkerView | None) -> WorkerView:
    if worker is None:
        raise UnavailableError(no_worker_message(view, role))
    return worker


def no_worker_message(view: FleetView, role: Role) -> str:
    total = sum(1 for w in view.workers if w.role is role)
    if total == 0:
        return f"no {role.value} worker is configured"
    return f"no healthy {role.value} worker (0 of {total} healthy); retry later"
