"""Proto <-> pdd types for the Worker service: the one place the wire meets the role contract
(``pdd.worker.roles``; roles never see a protobuf message). Pure functions, no I/O.

Proto3 cannot tell "unset" from zero, so zero means "default" where zero is not a valid
value: top_p 0 -> 1.0, repetition_penalty 0 -> 1.0, max_tokens 0 -> up to the end of the
context. Temperature 0 is greedy. ``logprobs`` -1 (or any negative) means none.
"""

from __future__ import annotations

from pdd.cache.messages import DrcSnapshot
from pdd.engine.types import (
    ConstraintSpec,
    EngineDelta,
    EngineStats,
    SamplingSpec,
    TokenLogprob,
)
from pdd.proto import worker_pb2 as pb
from pdd.worker.roles import (
    AwaitKvCall,
    AwaitKvResult,
    CancelKvCall,
    CancelKvResult,
    DrcEventsCall,
    DrcEventsResult,
    GenerateCall,
    KvAddress,
    KvDelta,
    KvDestination,
    KvInSpec,
    KvStats,
    PrepareKvCall,
    PrepareKvResult,
    SendKvCall,
    SendKvResult,
    SessionSpec,
    WarmKvCall,
    WarmKvResult,
)

_SOURCES = {pb.KvIn.TRANSFER: "transfer", pb.KvIn.DRC: "drc"}


def constraint_from_proto(c: pb.Constraint) -> ConstraintSpec:
    return ConstraintSpec(
        kind=c.kind, spec=c.spec, resume=tuple(c.resume), param=c.param or "response_format"
    )


def sampling_from_proto(
    p: pb.SamplingParams, constraint: pb.Constraint | None = None
) -> SamplingSpec:
    """Raises InvalidRequestError (from SamplingSpec) on out-of-range values."""
    return SamplingSpec(
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        max_tokens=p.max_tokens or None,
        stop_token_ids=tuple(p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
        logprobs=p.logprobs if p.logprobs >= 0 else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        constraint=None if constraint is None else constraint_from_proto(constraint),
        prior_output_tokens=p.prior_output_tokens,
        min_p=p.min_p,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        allowed_token_ids=tuple(p.allowed_token_ids),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        bad_words=tuple(tuple(w.ids) for w in p.bad_words),
    )


def delta_to_proto(d: EngineDelta, first: bool) -> pb.GenerateResponse:
    """One response per delta; prompt counts only on the first response of a stream."""
    resp = pb.GenerateResponse(
        token_ids=d.token_ids,
        finish_reason=d.finish_reason or "",
        stop_token_id=-1 if d.stop_token_id is None else d.stop_token_id,
    )
    if first:
        resp.num_prompt_tokens = d.num_prompt_tokens
        resp.num_cached_tokens = d.num_cached_tokens
    resp.logprobs.extend(_logprob_to_proto(lp) for lp in d.logprobs or ())
    resp.prompt_logprobs.extend(_logprob_to_proto(lp) for lp in d.prompt_logprobs)
    return resp


def _logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
    )  # fmt: skip


def call_from_proto(req: pb.GenerateRequest, spec: SamplingSpec) -> GenerateCall:
    """The role's view of a Generate; ``kv_in`` only when a source is set."""
    kv_in = None
    if req.HasField("kv_in") and req.kv_in.source in _SOURCES:
        k = req.kv_in
        kv_id = k.kv_request_id or req.request_id
        kv_in = KvInSpec(_SOURCES[k.source], kv_id, max(k.wait_s, 0.0))
    session = None
    if req.HasField("session") and req.session.id:
        session = SessionSpec(req.session.id, req.session.keep)
    return GenerateCall(
        request_id=req.request_id,
        prompt=list(req.prompt_token_ids),
        sampling=spec,
        kv_stage=req.kv_stage,
        kv_in=kv_in,
        cache_salt=req.cache_salt,
        session=session,
    )


def kv_delta_to_proto(out: KvDelta, first: bool) -> pb.GenerateResponse:
    """``delta_to_proto`` plus the role's KV fields (zero when it reports none)."""
    resp = delta_to_proto(out.delta, first)
    resp.kv_staged_blocks = out.staged_blocks
    resp.kv_loaded_tokens = out.loaded_tokens
    return resp


def stats_to_proto(
    worker_id: str, role: str, s: EngineStats, kv: KvStats | None = None
) -> pb.StatsResponse:
    resp = _engine_stats(worker_id, role, s)
    if kv is None:
        return resp
    resp.pinned_slots = kv.pinned_slots
    resp.open_transfers = kv.open_transfers
    resp.wan_bandwidth_bps = kv.wan_bandwidth_bps
    resp.wan_rtt_s = kv.wan_rtt_s
    resp.kv_bytes_sent = kv.kv_bytes_sent
    resp.kv_wire_bytes_sent = kv.kv_wire_bytes_sent
    resp.wan_wire_ratio = kv.wan_wire_ratio
    resp.kv_bytes_received = kv.kv_bytes_received
    resp.kv_refused_chunks = kv.kv_refused_chunks
    resp.kv_in_waits = kv.kv_in_waits
    resp.own_blocks_stored = kv.own_blocks_stored
    resp.md_sessions = kv.md_sessions
    resp.md_session_turns = kv.md_session_turns
    resp.kv_arena_blocks = kv.arena_blocks
    resp.kv_free_blocks = kv.free_blocks
    resp.drc_query_tokens = kv.drc_query_tokens
    resp.drc_hit_tokens = kv.drc_hit_tokens
    if kv.address is not None:
        resp.kv_address.CopyFrom(address_to_proto(kv.address))
    for link in kv.wan_links:
        resp.wan_links.add(peer=link.peer, bandwidth_bps=link.bandwidth_bps, rtt_s=link.rtt_s,
                           queued_bytes=link.queued_bytes)  # fmt: skip
    if kv.drc is not None:
        resp.drc_capacity_blocks = kv.drc.capacity_blocks
        resp.drc_used_blocks = kv.drc.committed_blocks
        resp.drc_evictions = kv.drc.evicted_blocks
    return resp


def _engine_stats(worker_id: str, role: str, s: EngineStats) -> pb.StatsResponse:
    return pb.StatsResponse(
        worker_id=worker_id,
        role=role,
        running_requests=s.running,
        waiting_requests=s.waiting,
        kv_cache_usage=s.kv_cache_usage,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_generated_tokens=s.generated_tokens,
        max_model_len=s.max_model_len,
        block_size=s.block_size,
        max_num_seqs=s.max_num_seqs,
        kv_block_bytes=s.kv_block_bytes,
        prefill_tokens_per_s=s.prefill_tokens_per_s,
        prefill_fixed_s=s.prefill_fixed_s,
    )


# --- the KV RPCs ------------------------------------------------------------------------------


def address_from_proto(a: pb.PeerAddress) -> KvAddress:
    return KvAddress(a.transport, a.host, a.port, a.ucx_address, a.host_id, a.name, a.probes)


def address_to_proto(a: KvAddress) -> pb.PeerAddress:
    return pb.PeerAddress(
        transport=a.transport, host=a.host, port=a.port, ucx_address=a.ucx_address,
        host_id=a.host_id, name=a.name, probes=a.probes,
    )  # fmt: skip


def send_kv_call(req: pb.SendKvRequest) -> SendKvCall:
    dests = tuple(
        KvDestination(address_from_proto(d.peer), d.first_block, d.landing_key, d.tail)
        for d in req.destinations
    )
    return SendKvCall(req.kv_request_id, dests, req.deadline_s)


def send_kv_response(r: SendKvResult) -> pb.SendKvResponse:
    return pb.SendKvResponse(
        staged_blocks=r.staged_blocks,
        bytes_per_destination=r.bytes_per_destination,
        wire_bytes_per_destination=r.wire_bytes_per_destination,
    )


def prepare_kv_call(req: pb.PrepareKvRequest) -> PrepareKvCall:
    prompt = tuple(req.prompt_token_ids)
    return PrepareKvCall(req.kv_request_id, prompt, req.lease_s, req.cache_salt)


def prepare_kv_response(r: PrepareKvResult) -> pb.PrepareKvResponse:
    return pb.PrepareKvResponse(
        cached_blocks=r.cached_blocks, reserved_blocks=r.reserved_blocks,
        address=address_to_proto(r.address), landing_key=r.landing_key,
    )  # fmt: skip


def await_kv_call(req: pb.AwaitKvRequest) -> AwaitKvCall:
    return AwaitKvCall(req.kv_request_id, req.timeout_s)


def await_kv_response(r: AwaitKvResult) -> pb.AwaitKvResponse:
    return pb.AwaitKvResponse(
        state=r.state, bytes_received=r.bytes_received, blocks_ready=r.blocks_ready,
        reason=r.reason,
    )  # fmt: skip


def cancel_kv_call(req: pb.CancelKvRequest) -> CancelKvCall:
    return CancelKvCall(req.kv_request_id, req.reason, req.background)


def cancel_kv_response(r: CancelKvResult) -> pb.CancelKvResponse:
    return pb.CancelKvResponse(found=r.found)


def drc_events_call(req: pb.DrcEventsRequest) -> DrcEventsCall:
    return DrcEventsCall(req.since)


def warm_kv_call(req: pb.WarmKvRequest) -> WarmKvCall:
    return WarmKvCall(tuple(address_from_proto(a) for a in req.peers))


def warm_kv_response(r: WarmKvResult) -> pb.WarmKvResponse:
    return pb.WarmKvResponse(warming=r.warming)


def drc_events_response(r: DrcEventsResult) -> pb.DrcEventsResponse:
    """The feed travels as JSON (pdd.cache.messages); ``snapshot`` tells the two kinds apart."""
    return pb.DrcEventsResponse(
        json=r.feed.model_dump_json(), snapshot=isinstance(r.feed, DrcSnapshot)
    )
