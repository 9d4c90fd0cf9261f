"""The P stage every disaggregated pipeline starts with: prefill, stage KV, send it out.

    router                     P (dc-a)                    RLD / MD / D
      |-- PrepareKv(prompt) -------------------------------> |  reserve slots for the
      |-- Generate(prompt, max_tokens=1, kv_stage) ->|       |  blocks it lacks; address
      |<- t1 (+ kv_staged_blocks) -------------------|       |
      |<- PrepareKv: cached_blocks c, address ---------------|
      |-- SendKv([RLD/D from block 0, MD from block c]) ->|  UCX / TCP, in parallel

``prefill()`` runs PrepareKv on every target concurrently with P's Generate and returns P's
one event (the caller decides whether t1 is emitted). With ``stream_kv`` (router.pdd, or the
request's override) it also starts ``send()`` at once: SendKv reaches P while it prefills, and
P sends each chunk's blocks as its forward ends (pdd.prefill.policy); the caller's ``send()``
then only collects that answer. ``send()`` waits for the PrepareKv
answers and asks P to send what each target lacks: MD (``from_cache``) from its cached
blocks, everyone else from block 0. A target that needs nothing is left out (and, unless
it is MD, whose DRC Generate uses its lease, released with CancelKv); when nobody needs
anything P's staged blocks are released with CancelKv too. It returns the ids of the
targets KV is on its way to, and records MD's cached tokens and the bytes queued for it.
A lost destination (its PrepareKv failed, or timed out: unreachable) gets nothing and is in
``lost``, so the caller does not send it the request either. A destination that answers
PrepareKv with no room (RESOURCE_EXHAUSTED: RLD's slots or MD's DRC are full) is live but gets
no KV either: it is in ``full``; the caller runs the request without it (a full RLD: p_md) or
lets it compute the prompt itself (a full MD), never failing the stream. A lost P (SendKv
failed) sends nothing: every reservation is cancelled and the destinations recompute the
prompt.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pdd.errors import OverloadedError, PddError, WorkerError
from pdd.proto import worker_pb2
from pdd.router.decide.recovery import is_unreachable, is_worker_loss
from pdd.router.drive.request_run import RequestRun
from pdd.router.fleet.workers import Prepared
from pdd.router.types import TokenEvent

log = logging.getLogger(__name__)


@dataclass
class Target:
    """A KV destination. ``from_cache``: send only the blocks its cache lacks (MD in pdd).
    ``recorded``: its cached tokens and bytes are the record's md_cached / wan_kv_bytes.
    ``tail``: also P's last block cut short, where it holds KV in P's own geometry (RLD: it
    then computes only P's token, not the prompt's tail)."""

    worker_id: str
    from_cache: bool = False
    recorded: bool = False
    tail: bool = False
    prepared: asyncio.Task[Prepared] | None = field(default=None, repr=False)


class PStage:
    def __init__(self, run: RequestRun, p_id: str, targets: list[Target], block_size: int):
        self._run = run  # its Generate (load tracking); the halves below are what it uses
        self._kv = run.kv
        self._stream = run.stream
        self._pool = run.pool
        self._trace = run.trace
        self._p = p_id
        self._targets = targets
        self._block_size = block_size
        self.staged_blocks = 0
        self.lost: set[str] = set()  # destinations whose PrepareKv failed or timed out
        self.full: set[str] = set()  # live destinations with no room for this KV (refused)
        self._sending: asyncio.Task[set[str]] | None = None  # send() started by prefill()

    async def prefill(self) -> TokenEvent:
        """P's first token, one merged event. Raises WorkerError if P fails the request."""
        for t in self._targets:
            t.prepared = self._kv.prepare(t.worker_id)
        self._kv.hold(self._p)
        req = self._stream.continuation(self._kv.kv_id, max_tokens=1, prompt_logprobs=True)
        stream = self._run.req.stream_kv
        streams = self._run.policy.stream_kv if stream is None else stream
        if streams and self._targets and self._block_size > 0:
            staging = len(req.prompt_token_ids) // self._block_size  # P stages every whole block
            self._sending = asyncio.get_running_loop().create_task(self._send(staging))
            self._sending.add_done_callback(_retrieved)
        tokens: list[int] = []
        logprobs, prompt_logprobs = [], []
        last: TokenEvent | None = None
        cached = 0
        try:
            async for event in self._run.generate(self._p, req, kv_stage=True):
                tokens.extend(event.token_ids)
                logprobs.extend(event.logprobs)
                prompt_logprobs.extend(event.prompt_logprobs)
                cached = max(cached, event.num_cached_tokens)
                last = event
            if last is None or last.finish_reason not in ("stop", "length"):
                reason = last.finish_reason if last else "nothing"
                raise WorkerError(f"prefill worker {self._p} ended the request with {reason!r}")
        except BaseException:
            if self._sending is not None:  # the caller releases every party next
                self._sending.cancel()
                await asyncio.gather(self._sending, return_exceptions=True)
            raise
        self.staged_blocks = last.kv_staged_blocks
        self._stream.p_cached_tokens = cached
        self._stream.prompt_logprobs = tuple(prompt_logprobs)
        return TokenEvent(
            token_ids=tuple(tokens), logprobs=tuple(logprobs), finish_reason=last.finish_reason,
            num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=cached,
            stop_token_id=last.stop_token_id, worker_id=self._p,
            kv_staged_blocks=last.kv_staged_blocks,
        )  # fmt: skip

    def _first_block(self, t: Target, cached_blocks: int) -> int:
        """P's first block to send ``t``: past the prefix its cache holds, which it counts in
        its own blocks (an MD of another block size regroups P's blocks as they land). Records
        MD's cached tokens."""
        if not t.from_cache:
            return 0
        try:
            stats = self._pool.last_stats(t.worker_id)
        except KeyError:  # it left the fleet: its send fails on its own
            stats = None
        size = stats.block_size if stats is not None and stats.block_size > 0 else self._block_size
        if t.recorded and size > 0:
            self._trace.md_cached_tokens = cached_blocks * size
        if self._block_size <= 0 or size <= 0:  # no geometry known yet: one block size
            return cached_blocks
        return cached_blocks * size // self._block_size

    def _same_geometry(self, worker_id: str) -> bool:
        """P's KV lands in ``worker_id``'s cache as it is, with no conversion."""
        p = self._pool.geometry(self._p)
        return p is not None and p == self._pool.geometry(worker_id)

    async def send(self) -> set[str]:
        """SendKv to every target that lacks blocks (started by ``prefill`` when streaming);
        returns their ids."""
        if self._sending is None:
            receiving = await self._send(self.staged_blocks)
        else:
            receiving = await self._sending
            if receiving and self.staged_blocks == 0:  # P staged nothing after all: none comes
                self._kv.release("P staged no KV", [self._p, *receiving])
                return set()
        if not receiving:  # here, not in _send: a streamed one may beat P's Generate to P
            self._kv.release("nothing to send", [self._p])
        return receiving

    async def _send(self, staged_blocks: int) -> set[str]:
        """``send`` of P's first ``staged_blocks`` blocks (staged, or being staged)."""
        dests: list[worker_pb2.KvDestination] = []
        receiving: list[Target] = []
        for t in self._targets:
            assert t.prepared is not None, "send() before prefill()"
            try:
                prep = await t.prepared
            except OverloadedError as exc:  # no room for this KV now: it gets none (doc)
                log.warning("request %s: %s", self._kv.kv_id, exc.message)
                self.full.add(t.worker_id)
                self._kv.release("no room for the KV", [t.worker_id])
                continue
            except PddError as exc:  # the destination is lost: it gets no KV (module doc)
                if not is_unreachable(exc):
                    raise
                self.lost.add(t.worker_id)
                self._pool.mark_unhealthy(t.worker_id, exc.message)
                self._kv.release("PrepareKv failed", [t.worker_id])
                continue
            first = self._first_block(t, prep.cached_blocks)
            if first < staged_blocks:
                tail = t.tail and self._same_geometry(t.worker_id)
                dests.append(worker_pb2.KvDestination(
                    peer=prep.address, first_block=first, landing_key=prep.landing_key,
                    tail=tail))  # fmt: skip
                receiving.append(t)
            elif not t.from_cache:  # its Generate will not name this KV: free the lease now
                self._kv.release("nothing to send", [t.worker_id])
        if not dests:
            return set()
        policy = self._run.policy
        client = self._pool.client(self._p)
        try:
            sent = await client.send_kv(self._kv.kv_id, dests, policy.send_kv_deadline_s)
        except PddError as exc:
            if not is_worker_loss(exc):
                raise
            self._pool.mark_unhealthy(self._p, exc.message)
            log.warning(
                "request %s: SendKv on %s failed (%s); the destinations recompute the prompt",
                self._kv.kv_id, self._p, exc.message,
            )  # fmt: skip
            self._kv.release("SendKv failed", [self._p, *(t.worker_id for t in receiving)])
            return set()
        self._kv.sent_at = asyncio.get_running_loop().time()
        for t, (raw, wire) in zip(receiving, sent, strict=False):
            if t.recorded:
                self._trace.wan_kv_bytes, self._trace.wan_kv_raw_bytes = wire, raw
        return {t.worker_id for t in receiving}


def _retrieved(task: asyncio.Task) -> None:
    """A streamed send nobody awaits (P's token ended the request) ends quietly."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("request's streamed SendKv ended: %s", task.exception())
