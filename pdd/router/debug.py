"""Debug views of the router: recent requests with their timelines, and the fleet.

``RequestLog`` keeps the last ``router.debug_requests`` request records (open and closed) in
insertion order, dropping the oldest; ``/debug/requests/{id}`` renders one with
``request_view``. ``TimelineObserver`` is the request scope's RPC observer
(``pdd.observability.context``): it turns each RPC the request made into a timeline entry
(PrepareKv answers, SendKv bytes per destination, AwaitKv's result and wait, each Generate
with its duration: prefill, relay, warm-ups, the switch; CancelKv, Abort). ``workers_view``
is ``/debug/workers``: each worker's health, load, KV plane, DRC and WAN estimate.

Everything runs on the router's event loop. Times in the views are milliseconds since the
request arrived.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any

from pdd.observability.context import RpcObservation
from pdd.protocol import Role
from pdd.router.fleet.pool import WorkerPool
from pdd.router.record import RequestRecord, TimelineEvent


class RequestLog:
    """The most recent ``capacity`` request records by id (0: keeps none)."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()

    def add(self, record: RequestRecord) -> None:
        if self._capacity <= 0:
            return
        self._records[record.request_id] = record
        self._records.move_to_end(record.request_id)
        while len(self._records) > self._capacity:
            self._records.popitem(last=False)

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def recent(self) -> list[RequestRecord]:
        """Newest first."""
        return list(reversed(self._records.values()))


class TimelineObserver:
    """Turns one request's RPC observations into its record's timeline entries."""

    def __init__(self, record: RequestRecord):
        self._record = record
        self._addresses: list[tuple[Any, str]] = []  # PrepareKv address -> worker id
        self._await_started: dict[str, tuple[float, int]] = {}  # worker -> first poll, polls

    def __call__(self, obs: RpcObservation) -> None:
        handler = getattr(self, f"_on_{obs.method}", None)
        if obs.error is not None and obs.method != "Generate":
            self._record.mark(obs.started, _snake(obs.method), obs.worker, error=obs.error,
                              duration_ms=_ms(obs.ended - obs.started))  # fmt: skip
        elif handler is not None:
            handler(obs)

    def _on_Generate(self, obs: RpcObservation) -> None:  # noqa: N802 (gRPC method name)
        req = obs.request
        referred = req.prompt_ref.tokens if req.HasField("prompt_ref") else 0
        detail: dict[str, object] = {
            "id": req.request_id,
            "prompt_tokens": referred + len(req.prompt_token_ids),
            "max_tokens": req.sampling.max_tokens,
            "duration_ms": _ms(obs.ended - obs.started),
            "outcome": "cancelled" if obs.error else "ended",
        }
        if referred:  # the worker had the prompt from PrepareKv: only the rest was sent
            detail["prompt_sent"] = len(req.prompt_token_ids)
        if req.kv_stage:
            detail["kv_stage"] = True
        if req.HasField("kv_in"):
            detail["kv_in"] = "drc" if req.kv_in.source == req.kv_in.DRC else "transfer"
        self._record.mark(obs.started, "generate", obs.worker, **detail)

    def _on_PrepareKv(self, obs: RpcObservation) -> None:  # noqa: N802
        resp = obs.response
        self._addresses.append((resp.address, obs.worker))
        self._record.mark(
            obs.ended, "prepare_kv", obs.worker, cached_blocks=resp.cached_blocks,
            reserved_blocks=resp.reserved_blocks, transport=resp.address.transport,
        )  # fmt: skip

    def _on_SendKv(self, obs: RpcObservation) -> None:  # noqa: N802
        sent = list(obs.response.bytes_per_destination)
        wire = list(obs.response.wire_bytes_per_destination)
        dests = []
        for i, d in enumerate(obs.request.destinations):
            to = next((w for a, w in self._addresses if a == d.peer), None)
            dest = {
                "to": to or f"{d.peer.host}:{d.peer.port}", "transport": d.peer.transport,
                "first_block": d.first_block, "bytes": sent[i] if i < len(sent) else None,
            }  # fmt: skip
            if i < len(wire):  # expected after P's codec (a P that reports it)
                dest["wire_bytes"] = wire[i]
            dests.append(dest)
        self._record.mark(obs.ended, "send_kv", obs.worker,
                          staged_blocks=obs.response.staged_blocks, destinations=dests)  # fmt: skip

    def _on_AwaitKv(self, obs: RpcObservation) -> None:  # noqa: N802
        first, polls = self._await_started.get(obs.worker, (obs.started, 0))
        resp = obs.response
        if resp.state == "timeout":  # one poll of many: fold them into the final entry
            self._await_started[obs.worker] = (first, polls + 1)
            return
        self._await_started.pop(obs.worker, None)
        self._record.mark(
            obs.ended, "await_kv", obs.worker, state=resp.state, reason=resp.reason,
            bytes_received=resp.bytes_received, blocks_ready=resp.blocks_ready,
            waited_ms=_ms(obs.ended - first), polls=polls + 1,
        )  # fmt: skip

    def _on_CancelKv(self, obs: RpcObservation) -> None:  # noqa: N802
        self._record.mark(obs.ended, "cancel_kv", obs.worker, reason=obs.request.reason,
                          found=obs.response.found)  # fmt: skip

    def _on_Abort(self, obs: RpcObservation) -> None:  # noqa: N802
        self._record.mark(obs.ended, "abort", obs.worker, id=obs.request.request_id,
                          found=obs.response.found)  # fmt: skip


def _snake(method: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in method).lstrip("_")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _entry(record: RequestRecord, e: TimelineEvent) -> dict[str, object]:
    return {"t_ms": _ms(e.at - record.arrival), "event": e.event, "worker": e.worker, **e.detail}


def _route(record: RequestRecord) -> dict[str, object]:
    d = record.decision
    return {
        "pipeline": d.pipeline.value,
        "workers": {role.value: wid for role, wid in d.assignments},
        "prompt_tokens": record.prompt_tokens,
        "md_cached_tokens": d.md_cached_tokens,  # the router's DRC view, before PrepareKv
        "wan_bytes": d.wan_bytes,
        "eta_s": _finite(d.eta_s),  # when MD can start (its KV landed, or computed)
        "md_computes": d.md_computes,
        "handoff": d.handoff.value,
        "block_size": d.block_size,
    }


def request_view(record: RequestRecord, sla: tuple[float, float]) -> dict[str, object]:
    """The JSON of ``/debug/requests/{id}``."""
    t = record.trace
    events = [TimelineEvent(record.arrival, "arrival"),
              TimelineEvent(record.routed_at, "route", None, _route(record)), *record.timeline]  # fmt: skip
    if record.finished_at is not None:
        events.append(TimelineEvent(record.finished_at, "finish", None, {
            "finish_reason": record.finish_reason, "completion_tokens": record.completion_tokens,
        }))  # fmt: skip
    events.sort(key=lambda e: e.at)  # stable: same-time entries keep their order
    return {
        "request_id": record.request_id,
        "state": "running" if record.finished_at is None else "finished",
        "age_s": round(time.monotonic() - record.arrival, 3),
        "route": _route(record),
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "cached_tokens": record.cached_tokens,
        "finish_reason": record.finish_reason,
        "error": record.error,
        "ttft_ms": _ms(record.ttft),
        "tpot_ms": _ms(record.tpot),
        "e2e_ms": _ms(record.e2e),
        "sla_good": None if record.finished_at is None else record.meets_sla(*sla),
        "pdd": {
            **t.summary().as_json(),
            "tokens_by_tier": dict(t.tokens),
            "kv_state": t.kv_state or None,
            "kv_reason": t.kv_reason or None,
            "kv_deferred": t.kv_deferred,
            "handoff_stall_ms": _ms(t.handoff_stall_s),
        },
        "timeline": [_entry(record, e) for e in events],
    }


def recent_view(log: RequestLog) -> list[dict[str, object]]:
    """One line per kept request, newest first (``/debug/requests``)."""
    return [
        {"request_id": r.request_id, "pipeline": r.pipeline.value,
         "state": "running" if r.finished_at is None else "finished",
         "finish_reason": r.finish_reason, "ttft_ms": _ms(r.ttft), "e2e_ms": _ms(r.e2e)}
        for r in log.recent()
    ]  # fmt: skip


def workers_view(pool: WorkerPool) -> list[dict[str, object]]:
    """``pool.describe()`` plus each worker's last Stats: load, KV plane, DRC, WAN."""
    views = {w.id: w for w in pool.view().workers}
    out = []
    for row in pool.describe():
        w = views[str(row["id"])]
        stats = pool.last_stats(w.id)
        row.update(datacenter=w.datacenter, waiting=w.waiting, max_num_seqs=w.max_num_seqs,
                   kv_cache_usage=w.kv_cache_usage)  # fmt: skip
        if stats is not None and w.role is not Role.COLOCATED:
            row["kv_plane"] = {
                "pinned_slots": stats.pinned_slots, "open_transfers": stats.open_transfers,
                "bytes_sent": stats.kv_bytes_sent, "bytes_received": stats.kv_bytes_received,
                "arena_blocks": stats.kv_arena_blocks, "free_blocks": stats.kv_free_blocks,
            }  # fmt: skip
        if w.role is Role.PREFILL:
            row["wan"] = {"bandwidth_bps": w.wan_bandwidth_bps, "rtt_s": w.wan_rtt_s,
                          "links": {peer: {"bandwidth_bps": link.bandwidth_bps,
                                           "rtt_s": link.rtt_s,
                                           "queued_bytes": link.queued_bytes}
                                    for peer, link in w.wan_links}}  # fmt: skip
        if w.role is Role.MAIN_DECODE and stats is not None:
            row["drc_stats"] = _drc_stats(stats)
            row["prefill"] = {"tokens_per_s": w.prefill_tokens_per_s,
                              "fixed_s": w.prefill_fixed_s}  # fmt: skip
        out.append(row)
    return out


def _drc_stats(stats: Any) -> dict[str, object]:
    cap, used = stats.drc_capacity_blocks, stats.drc_used_blocks
    queried, hit = stats.drc_query_tokens, stats.drc_hit_tokens
    return {
        "capacity_blocks": cap, "used_blocks": used, "fill": used / cap if cap else None,
        "query_tokens": queried, "hit_tokens": hit, "hit_rate": hit / queried if queried else None,
        "evictions": stats.drc_evictions,
    }  # fmt: skip
