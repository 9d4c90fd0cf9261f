"""Simulated machinery: a decode batch, a shared link, a serial prefill queue (simpy).

``DecodeServer`` advances its whole batch between events instead of per token: the step time
``decode_step(batch, context)`` is held constant from one event (a sequence joins, leaves or
finishes) to the next and recomputed at each, so a request costs a handful of events however
many tokens it has (the documented approximation: context growth inside one such interval is
counted at its end). One-off forwards (extend-decode on MD, a colocated prefill) stall the
whole batch through ``add_extra``. Sequences are admitted FIFO while the batch has a free slot
and their whole final context fits the device KV.

``Link`` shares its rate like pdd's TCP sender, which takes the next chunk from the open
transfer with the fewest bytes left (``pdd.transfer.tcp_send``): that one gets the whole link,
so a small p_md transfer is never stuck behind a multi-GB cold one; a transfer lands half an
RTT after its last byte left; ``cancel`` cuts one and the link goes on with the rest;
``defer`` moves one behind the others (it is carried only while no other transfer is open).
Everything runs on simpy event callbacks, no process per server.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import simpy
from simpy.events import NORMAL

from pdd.plan.profile import ChipProfile

_BYTE_EPS = 1e-6  # transfers within this many bytes of the first to finish finish with it


@dataclass(eq=False, slots=True)
class Seq:
    """One request's stretch on one decoder."""

    remaining: float  # tokens to generate here (fixed; what is left: DecodeServer.generated)
    context: float  # KV tokens it reads per step (when it joined; + generated when it left)
    done: simpy.Event
    reserve: float = 0.0  # device KV reserved at admission (final context)
    generated: float = 0.0  # set when it leaves; while it runs, ask DecodeServer.generated
    first_at: float = -1.0  # when its first token here was out (-1: not yet)
    extra_s: float = 0.0  # its one-off forward (extend-decode), run when it is admitted
    admitted_at: float = -1.0
    start: float = 0.0  # the server's progress when it joined the batch
    end: float = 0.0  # the progress at which it is done (start + remaining)
    order: int = 0  # admission number (finishing together: in admission order)


@dataclass(eq=False)
class DecodeServer:
    """A decode batch. Every running sequence gains the same tokens between two events, so
    the server keeps one counter, ``progress`` (tokens each running sequence generated since
    the server started), and a sequence its ``start``/``end`` on it: an event costs O(1) in
    the batch size plus O(log batch) per sequence that finishes (a heap of ends)."""

    env: simpy.Environment
    id: str
    profile: ChipProfile
    max_seqs: int
    running: dict[Seq, None] = field(default_factory=dict)  # admission order
    waiting: deque[Seq] = field(default_factory=deque)
    in_flight: int = 0  # the router's count (routing -> the request leaves this worker)
    tokens: float = 0.0  # generated here in all
    busy_s: float = 0.0  # time with a non-empty batch
    occupancy_s: float = 0.0  # integral of (running + waiting) / max_seqs over time
    progress: float = 0.0
    _ends: list[tuple[float, int, Seq]] = field(default_factory=list)  # heap; stale entries
    _fresh: list[Seq] = field(default_factory=list)  # running, first token not out yet
    _admitted: int = 0
    _ctx: float = 0.0
    _kv: float = 0.0
    _extra: float = 0.0
    _step: float = 0.0
    _t: float = 0.0
    _due: float = -1.0  # when the armed timer fires (-1: none armed)

    def __post_init__(self) -> None:
        d = self.profile.decode
        self._coef = (d.step_fixed_s, d.per_seq_s, d.per_context_token_s)
        self._cap = self.profile.memory.kv_capacity_tokens

    def add(self, seq: Seq, extra_s: float = 0.0) -> None:
        """Queue ``seq``; ``extra_s`` is its one-off forward (extend-decode), run before it
        joins the batch's steps. ``seq.done`` fires when it has generated ``remaining``."""
        self.advance()
        seq.reserve = seq.context + seq.remaining
        seq.extra_s = extra_s
        self.waiting.append(seq)
        self._admit()
        self._reschedule()

    def generated(self, seq: Seq) -> float:
        """Tokens ``seq`` generated here so far (call ``advance`` first for "now")."""
        if seq in self.running:
            return min(self.progress - seq.start, seq.remaining)
        return seq.generated

    def remove(self, seq: Seq) -> int:
        """Take ``seq`` out (handoff, abort); returns the whole tokens it generated here."""
        self.advance()
        if seq in self.running:
            self._leave(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._admit()
        self._reschedule()
        return int(seq.generated)

    def _leave(self, seq: Seq) -> None:
        del self.running[seq]  # its heap entry goes stale
        seq.generated = min(self.progress - seq.start, seq.remaining)
        seq.context += seq.generated
        self._ctx -= seq.context
        self._kv -= seq.reserve
        if seq.first_at < 0 and seq in self._fresh:
            self._fresh.remove(seq)

    def add_extra(self, seconds: float) -> None:
        """A one-off forward that stalls the batch (a Catch-Up round, a colocated prefill)."""
        self.advance()
        self._extra += seconds
        self._reschedule()

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def _admit(self) -> None:
        cap, running = self._cap, self.running
        while self.waiting and len(running) < self.max_seqs:
            seq = self.waiting[0]
            if running and self._kv + seq.reserve > cap:
                return
            self.waiting.popleft()
            running[seq] = None
            seq.start, seq.end = self.progress, self.progress + seq.remaining
            self._admitted += 1
            seq.order = self._admitted
            heapq.heappush(self._ends, (seq.end, seq.order, seq))
            self._fresh.append(seq)
            self._ctx += seq.context
            self._kv += seq.reserve
            self._extra += seq.extra_s
            seq.admitted_at = self.env.now

    def advance(self) -> None:
        now = self.env.now
        dt, self._t = now - self._t, now
        if not self.running or dt <= 0:
            return
        k = len(self.running)
        self.busy_s += dt
        self.occupancy_s += dt * (k + len(self.waiting)) / self.max_seqs
        used = min(dt, self._extra)
        self._extra -= used
        if self._step <= 0:
            return
        n = (dt - used) / self._step
        if n <= 0:
            return
        self.progress += n
        self._ctx += n * k
        self.tokens += n * k
        if self._fresh:
            waiting_first = []
            for s in self._fresh:
                g = min(self.progress - s.start, s.remaining)
                if g >= 1 - 1e-9:
                    s.first_at = now - (g - 1) * self._step
                else:
                    waiting_first.append(s)
            self._fresh = waiting_first

    def _soonest_end(self) -> float:
        ends = self._ends
        while ends and ends[0][2] not in self.running:
            heapq.heappop(ends)  # a sequence that left early (handoff)
        return ends[0][0]

    def _reschedule(self) -> None:
        """Arm the timer for the next finish. An armed timer due no later is kept (it wakes,
        finds nothing done and re-arms): most joins and leaves then cost no new event."""
        if not self.running:
            self._extra = 0.0
            return
        fixed, per_seq, per_ctx = self._coef
        step = self._step = fixed + len(self.running) * per_seq + self._ctx * per_ctx
        soonest = self._soonest_end() - self.progress
        now = self.env.now
        due = now + self._extra + (soonest if soonest > 0.0 else 0.0) * step
        if now <= self._due <= due:
            return
        self._due = due
        self.env.timeout(due - now).callbacks.append(lambda _e: self._on_timer(due))

    def _on_timer(self, due: float) -> None:
        if due != self._due:
            return  # superseded by an earlier timer
        self._due = -1.0
        self.advance()
        finished = []
        ends, limit = self._ends, self.progress + 1e-6
        while ends and (ends[0][0] <= limit or ends[0][2] not in self.running):
            _, _, s = heapq.heappop(ends)
            if s in self.running:
                finished.append(s)
        if len(finished) > 1:
            finished.sort(key=lambda s: s.order)
        for s in finished:
            self._leave(s)
            if s.first_at < 0:
                s.first_at = self.env.now
            s.done.succeed()
        self._admit()
        self._reschedule()


class PrefillQueue:
    """One worker's serial prefill, first come first served (a ``simpy.Resource(1)`` without
    its request and release events: an idle worker starts at once)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env, self.busy, self.waiting = env, False, deque[simpy.Event]()

    def acquire(self) -> simpy.Event | None:
        """None: the prefill starts now; else the event that fires when its turn comes."""
        if not self.busy:
            self.busy = True
            return None
        ev = self.env.event()
        self.waiting.append(ev)
        return ev

    def release(self) -> None:
        """The running prefill ended: the next in line starts (now), or the worker idles."""
        if self.waiting:
            self.waiting.popleft().succeed()
        else:
            self.busy = False


class Landing(simpy.Event):
    """``Transfer.landed``: waited on from the send, armed when the last byte left (it then
    fires half an RTT later, as a simpy Timeout would, without a second event)."""

    def arm(self, delay: float) -> None:
        self._ok, self._value = True, None
        self.env.schedule(self, NORMAL, delay)


@dataclass(eq=False, slots=True)
class Transfer:
    nbytes: int
    landed: Landing
    sent: float = 0.0  # bytes that crossed (less than nbytes if cancelled)
    cancelled: bool = False
    background: bool = False  # deferred: carried only while no other transfer is open
    started: float = 0.0  # when it was sent


@dataclass(eq=False)
class Link:
    """A shared link: all of ``bandwidth_bps`` to the open transfer with the fewest bytes
    left, one-way delay ``rtt_s / 2`` (module docstring)."""

    env: simpy.Environment
    bandwidth_bps: float
    rtt_s: float
    open: list[Transfer] = field(default_factory=list)
    busy_s: float = 0.0
    bytes_sent: float = 0.0
    _since: float = 0.0  # when ``sent`` of every open transfer was last brought up to date
    _gen: int = 0

    def send(self, nbytes: int) -> Transfer:
        """Open a transfer of ``nbytes``; ``landed`` fires when the last byte arrived."""
        t = Transfer(nbytes, Landing(self.env), started=self.env.now)
        if nbytes <= 0:
            t.landed.arm(self.rtt_s / 2)
            return t
        self._advance()
        self.open.append(t)
        self._schedule()
        return t

    def cancel(self, t: Transfer) -> None:
        """Cut it now (the bytes already sent stay counted); the link goes on with the rest.
        One whose last byte already left lands anyway (no one waits for it)."""
        if t.landed.triggered or t.cancelled:
            return
        t.cancelled = True
        if t in self.open:
            self._advance()
            self.open.remove(t)
            self._schedule()

    @property
    def last_change(self) -> float:
        """When the set of open transfers last changed (its bytes are counted up to then)."""
        return self._since

    def defer(self, t: Transfer) -> None:
        """Nobody waits for it any more: from now on it shares the link only while no other
        transfer is open (pdd's sender serves deferred transfers from a second queue)."""
        if t.landed.triggered or t.cancelled or t.background:
            return
        self._advance()
        t.background = True
        self._schedule()

    def _sharing(self) -> list[Transfer]:
        """The transfer the link carries now: of the foreground ones (else the deferred ones),
        the one with the fewest bytes left (the first of equals, as pdd's sender takes)."""
        carried = [t for t in self.open if not t.background] or self.open
        return [min(carried, key=lambda t: t.nbytes - t.sent)] if carried else []

    def _advance(self) -> None:
        """Credit the transfer carried its bytes since ``_since``."""
        now = self.env.now
        dt, self._since = now - self._since, now
        if not self.open or dt <= 0:
            return
        self.busy_s += dt
        sharing = self._sharing()
        share = dt * self.bandwidth_bps / 8 / len(sharing)
        for t in sharing:
            step = min(share, t.nbytes - t.sent)
            t.sent += step
            self.bytes_sent += step

    def _schedule(self) -> None:
        """One timer: when the carried transfer with the fewest bytes left will finish."""
        self._gen += 1
        if not self.open:
            return
        sharing = self._sharing()
        left = min(t.nbytes - t.sent for t in sharing)
        gen = self._gen
        ev = self.env.timeout(max(left, 0.0) * 8 * len(sharing) / self.bandwidth_bps)
        ev.callbacks.append(lambda _e: self._done(gen))

    def _done(self, gen: int) -> None:
        if gen != self._gen:
            return  # the set of open transfers changed since this timer was set
        self._advance()
        sharing = self._sharing()
        least = min(t.nbytes - t.sent for t in sharing)
        for t in [t for t in sharing if t.nbytes - t.sent <= least + _BYTE_EPS]:
            self.bytes_sent += t.nbytes - t.sent
            t.sent = t.nbytes
            self.open.remove(t)
            t.landed.arm(self.rtt_s / 2)
        self._schedule()

    def utilisation(self, duration_s: float) -> float:
        busy = self.busy_s + (self.env.now - self._since if self.open else 0.0)
        return busy / duration_s if duration_s > 0 else 0.0
