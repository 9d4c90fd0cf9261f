"""The discrete-event simulation of one fleet serving one workload (simpy).

Routing is pdd's own: every request builds the ``FleetView`` / ``RouteRequest`` the router
builds and calls ``pdd.router.decide.routing.choose`` (the pure function ``pdd router`` runs),
so the pipeline (p_md or p_rld_md), the P, RLD and MD picked and the handoff mode are the
router's decisions. The simulator only plays out what the drivers then do:

    pdd       P prefills (its prefix cache) -> first token (TTFT). Blocks MD lacks cross the WAN
              link (fewest bytes left first); p_md: MD starts when they landed, recomputing the tail block and the
              token (extend-decode). p_rld_md: every block goes to RLD over the local link, RLD
              decodes; when the WAN KV landed, One-Shot (RLD stops, MD extends all emitted
              tokens) or Catch-Up (MD extends what RLD emitted, in rounds, while RLD goes on, until
              fewer than catch_up_threshold_tokens are missing, after min_catch_up_rounds, or
              max_catch_up_rounds). RLD
              finishing first leaves the WAN transfer to finish behind every other; the
              conversation's next request to that MD cuts it (pdd.plan.pipeline).
              MD's DRC (host tier, LRU) stores prompt and answer when the request ends.
    pd_wan    P prefills, the blocks D's DRC lacks cross the WAN (as vLLM's decoder pulls
              only what its prefix cache lacks), D decodes every token (TTFT on D) and stores
              prompt and answer when the request ends.
    pd_local  the same over the local link.
    colocated one worker prefills (stalling its decode batch) and decodes.

Every request first waits its first worker's ``serving.request_s`` (what the router and gRPC
add outside the engine, measured by ``pdd profile``; 0 in a datasheet profile).

What is simplified is in the servers' docstring (pdd.plan.servers) and docs/operations.md.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace

import simpy

from pdd.config.router import PddPolicyConfig
from pdd.errors import UnavailableError
from pdd.plan.cache import Holders, PrefixCache, make_cache, rebase
from pdd.plan.fleet import Fleet
from pdd.plan.pipeline import finish, land, run_pdd
from pdd.plan.profile import ChipProfile
from pdd.plan.servers import DecodeServer, Link, PrefillQueue, Seq, Transfer
from pdd.plan.stats import RequestLog, SimResult, Sla, summarize
from pdd.plan.workload import Conversation, Turn, Workload
from pdd.protocol import HandoffMode, Pipeline, Role, RouterMode
from pdd.router.decide import policy, routing
from pdd.router.decide.view import Decision, FleetView, RouteRequest, WorkerView


@dataclass(frozen=True, slots=True)
class Wan:
    bandwidth_bps: float
    rtt_s: float
    price_per_gb: float = 0.0


@dataclass(frozen=True, slots=True)
class SimSettings:
    policy: PddPolicyConfig = field(default_factory=PddPolicyConfig)
    local_bandwidth_bps: float = 400e9  # P -> RLD / pd_local D: RDMA inside dc-a
    local_rtt_s: float = 10e-6
    exact_cache: bool = False  # RadixIndex per block instead of the per-conversation LRU
    warmup_fraction: float = 0.1
    # pdd's router routes the baselines' P (and colocated workers) least-loaded, with no
    # prefix affinity; True gives them pdd's P scorer (policy.pick_p) as a KV-aware router
    # would (vLLM production-stack, Dynamo), False plays pdd's router exactly.
    baseline_affinity: bool = True


class SimFleetView(FleetView):
    """The router's ``FleetView`` with ``healthy`` remembered per role: in the simulation no
    worker changes health or role, so the list is the same on every call (a copy is handed
    out, as the router's fresh list would be)."""

    __slots__ = ("_healthy",)

    def __init__(self, mode: RouterMode, workers: tuple[WorkerView, ...],
                 policy: PddPolicyConfig) -> None:  # fmt: skip
        super().__init__(mode, workers, policy)
        object.__setattr__(self, "_healthy", {})

    def healthy(self, *roles: Role) -> list[WorkerView]:
        got = self._healthy.get(roles)
        if got is None:
            got = self._healthy[roles] = FleetView.healthy(self, *roles)
        return list(got)


@dataclass(eq=False)
class Worker:
    """One simulated instance: a prefill queue and/or a decode batch, and a prefix cache."""

    id: str
    role: Role
    profile: ChipProfile
    cache: PrefixCache | None
    decode: DecodeServer | None = None
    prefill: PrefillQueue | None = None
    in_flight: int = 0
    prefill_busy_s: float = 0.0


class Simulation:
    """One run: ``Simulation(fleet, profiles, wan, workload, sla).run() -> SimResult``."""

    def __init__(self, fleet: Fleet, profiles: dict[str, ChipProfile], wan: Wan,
                 workload: Workload, sla: Sla, settings: SimSettings | None = None) -> None:  # fmt: skip
        self.fleet, self.wan, self.workload, self.sla = fleet, wan, workload, sla
        self.settings = settings or SimSettings()
        self.prices = {name: p.price_per_hour for name, p in profiles.items()}
        self.env = simpy.Environment()
        self.link = Link(self.env, wan.bandwidth_bps, wan.rtt_s)
        self.log = RequestLog()
        self.starved = 0
        self.last_end = 0.0  # when the last request ended
        self.conversation_spans: list[float] = []  # first arrival -> last turn's end
        self.workers: dict[str, Worker] = {}
        # (MD, conversation) -> the transfer still crossing after RLD ended its request
        self.deferred: dict[tuple[str, int], _Deferred] = {}
        self._views: dict[str, WorkerView] = {}
        # who holds each conversation, per role (the O(1) caches; None: exact caches)
        self.holders: dict[Role, Holders] | None = (
            None if self.settings.exact_cache else {r: {} for r in Role}
        )
        mean_final = _mean_final_context(workload)
        for g in fleet.groups:
            prof = profiles[g.chip]
            for i in range(g.count):
                self._add_worker(f"{g.role.value}-{g.chip}-{i}", g.role, prof, mean_final)
        # one snapshot for the whole run: its WorkerViews are updated in place (``_bump``)
        self.view = SimFleetView(fleet.mode, tuple(self._views.values()), self.settings.policy)
        self.by_role = {r: [w for w in self.workers.values() if w.role is r] for r in Role}

    def _add_worker(self, wid: str, role: Role, prof: ChipProfile, mean_final: float) -> None:
        mem = prof.memory
        max_seqs = max(1, min(mem.max_batch, int(mem.kv_capacity_tokens // max(mean_final, 1))))
        exact, holders = self.settings.exact_cache, self.holders and self.holders[role]
        capacity = {
            Role.PREFILL: mem.kv_capacity_tokens,
            Role.COLOCATED: mem.kv_capacity_tokens,
            Role.MAIN_DECODE: mem.host_cache_tokens,  # its DRC (the baselines' D too)
            Role.RELAY_DECODE: None,
        }[role]  # fmt: skip
        cache = (None if capacity is None
                 else make_cache(exact, capacity, prof.block_size, wid, holders))  # fmt: skip
        w = Worker(wid, role, prof, cache)
        prefill = prof.prefill  # what a real MD measures at start (Engine.measure_prefill)
        rate = 1 / prefill.per_token_s if role is Role.MAIN_DECODE and prefill.per_token_s else 0.0
        if role is not Role.PREFILL:
            w.decode = DecodeServer(self.env, wid, prof, max_seqs)
        if role in (Role.PREFILL, Role.COLOCATED):
            w.prefill = PrefillQueue(self.env)
        self.workers[wid] = w
        self._views[wid] = WorkerView(
            id=wid, role=role, healthy=True, datacenter=self.fleet.datacenter(role),
            max_num_seqs=max_seqs if role is not Role.PREFILL else 0,
            block_size=prof.block_size, kv_block_bytes=prof.block_size * prof.kv_bytes_per_token,
            wan_bandwidth_bps=self.wan.bandwidth_bps if role is Role.PREFILL else 0.0,
            wan_rtt_s=self.wan.rtt_s if role is Role.PREFILL else 0.0,
            prefill_tokens_per_s=rate, prefill_fixed_s=prefill.chunk_overhead_s if rate else 0.0,
        )  # fmt: skip

    def profile_price(self, chip: str) -> float:
        return self.prices[chip]

    # --- routing: the router's own function over the snapshot it would see ------------------

    def _bump(self, w: Worker, delta: int) -> None:
        """The router's live count of requests on ``w`` (and how many it was given).

        The views are this simulation's own snapshot objects, never shared with a router and
        not kept by ``choose`` beyond one call, so they are updated in place: a
        ``dataclasses.replace`` per change was a tenth of the run time at a million requests.
        """
        w.in_flight += delta
        v = self._views[w.id]
        object.__setattr__(v, "in_flight", w.in_flight)
        if delta > 0:
            object.__setattr__(v, "served", v.served + delta)

    def route(self, conv: int, turn: Turn) -> Decision:
        """``routing.choose`` on this instant's snapshot (load, DRC and P-cache contents)."""
        n = turn.prompt_tokens
        md_cached = self._cached(Role.MAIN_DECODE, conv, n)
        p_role = Role.COLOCATED if self.fleet.mode is RouterMode.COLOCATED else Role.PREFILL
        p_cached = self._cached(p_role, conv, n)
        view = self.view
        req = RouteRequest(n, turn.output_tokens, md_cached, p_cached)
        decision = routing.choose(view, req)
        if self.settings.baseline_affinity and decision.pipeline in _AFFINE:
            decision = self._with_affine_p(decision, view, req)
        wanted_rld = decision.eta_s > self.settings.policy.ttft_budget_s
        if decision.pipeline is Pipeline.P_MD and wanted_rld:
            self.starved += 1  # p_rld_md was due, no RLD had a slot: degraded to p_md
        return decision

    def _cached(self, role: Role, conv: int, tokens: int) -> dict[str, int]:
        """Per worker of ``role``, the tokens of this prompt its cache holds (non-zero only)."""
        if self.holders is None:
            return _cached(self.by_role[role], conv, tokens)
        out = {}
        for wid, cache in self.holders[role].get(conv, {}).items():
            n = cache.cached_tokens(conv, tokens)
            if n:
                out[wid] = n
        return out

    def _with_affine_p(self, d: Decision, view: FleetView, req: RouteRequest) -> Decision:
        """Baselines with prefix affinity: the first worker (P, or the colocated one) chosen
        by the router's own pdd scorer (``policy.pick_p``: hit - p_load_weight * load)
        instead of least-loaded (see ``SimSettings.baseline_affinity``)."""
        role = d.assignments[0][0]
        pool = view.healthy(role)
        best = policy.pick_p(pool, req.p_cached_tokens, req.prompt_tokens,
                             view.policy.p_load_weight)  # fmt: skip
        assert best is not None  # choose() found one in the same pool
        return replace(d, assignments=((role, best.id), *d.assignments[1:]))

    # --- the run -----------------------------------------------------------------------------

    def run(self) -> SimResult:
        started, cpu = time.perf_counter(), time.process_time()
        self.env.process(self._arrivals())
        # The run's objects die by reference counting (events drop their callbacks once
        # processed), so the cyclic collector would only rescan the workload's million
        # turns, again and again: paused for the run (a tenth of the time at 1M requests).
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.env.run()
        finally:
            if collecting:
                gc.enable()
        wall = time.perf_counter() - started
        return summarize(self, wall, time.process_time() - cpu)

    def _arrivals(self):  # noqa: ANN202 (a simpy process)
        """Start each conversation when it arrives: one pending arrival, not one timer per
        conversation, so the event heap holds only what is in flight (at 1M requests the
        50,000 start timers made every heap operation slower)."""
        env = self.env
        for conv in sorted(self.workload.conversations, key=lambda c: c.start_s):
            if conv.start_s > env.now:
                yield env.timeout(conv.start_s - env.now)
            env.process(self._conversation(conv))

    def _conversation(self, conv: Conversation):  # noqa: ANN202 (a simpy process)
        """Its turns one after the other; each request runs inline (no process of its own,
        and one generator level less: every resume of a stage passes through each level)."""
        for turn in conv.turns:
            if turn.at_s is not None and turn.at_s > self.env.now:
                yield self.env.timeout(turn.at_s - self.env.now)
            elif turn.think_s:
                yield self.env.timeout(turn.think_s)
            if turn.prefix_tokens is not None:
                for w in self.workers.values():
                    if w.cache is not None:
                        rebase(w.cache, conv.id, turn.prefix_tokens, turn.prefix_of)
            rec = self._admit(conv.id, turn)
            if rec is None:
                continue
            overhead = rec.workers[0].profile.serving.request_s  # the router's, then gRPC
            if overhead:
                yield self.env.timeout(overhead)
            pipeline = rec.decision.pipeline
            if pipeline is Pipeline.COLOCATED:
                yield from self._colocated(conv.id, turn, rec)
            elif pipeline is Pipeline.PD:
                yield from self._pd(conv.id, turn, rec)
            else:
                yield from run_pdd(self, conv.id, turn, rec)
            self._done(turn, rec)
        self.conversation_spans.append(self.env.now - conv.start_s)

    def _admit(self, conv: int, turn: Turn) -> Record | None:
        """A request arrives: routed, its workers' counts raised (None: no worker, logged)."""
        arrival = self.env.now
        try:
            decision = self.route(conv, turn)
        except UnavailableError:
            self.log.add(arrival, None, None, turn.output_tokens, "unavailable",
                         measured=turn.measured)  # fmt: skip
            return None
        rec = Record(arrival, decision, [self.workers[wid] for _, wid in decision.assignments])
        for w in rec.workers:
            self._bump(w, +1)
        return rec

    def _done(self, turn: Turn, rec: Record) -> None:
        """A request ended: counts of the workers it still held lowered, its figures logged."""
        for w in rec.workers:
            if w.in_flight and rec.released.get(w.id) is None:
                self._bump(w, -1)
        self.last_end = self.env.now
        rec.log_index = self.log.add(rec.arrival, rec.first_at, self.env.now, turn.output_tokens,
                     rec.pipeline, rec.rld_tokens, rec.wan_bytes, rec.handoff, rec.p_wait,
                     turn.measured)  # fmt: skip

    def release(self, rec: Record, w: Worker) -> None:
        if rec.released.get(w.id) is None:
            rec.released[w.id] = self.env.now
            self._bump(w, -1)

    def prefill_stage(self, p: Worker, conv: int, turn: Turn, rec: Record):  # noqa: ANN202
        assert p.prefill is not None and p.cache is not None
        t0 = self.env.now
        turn_ = p.prefill.acquire()
        if turn_ is not None:  # queued behind another prefill
            yield turn_
        rec.p_wait = self.env.now - t0
        cached = p.cache.cached_tokens(conv, turn.prompt_tokens)
        seconds = p.profile.prefill_s(turn.prompt_tokens - cached, cached)
        if p.decode is not None:  # colocated: the prefill stalls its decode batch
            p.decode.add_extra(seconds)
        yield self.env.timeout(seconds)
        p.prefill_busy_s += seconds
        p.cache.store(conv, turn.prompt_tokens)
        p.prefill.release()

    def _colocated(self, conv: int, turn: Turn, rec: Record):  # noqa: ANN202
        c = self.workers[rec.decision.worker(Role.COLOCATED)]
        yield from self.prefill_stage(c, conv, turn, rec)
        rec.first_at = self.env.now
        yield from self.decode(c, turn.prompt_tokens + 1, turn.output_tokens - 1, 0.0)
        assert c.cache is not None
        c.cache.store(conv, turn.prompt_tokens + turn.output_tokens)

    def decode(self, w: Worker, context: int, tokens: float, extra_s: float):  # noqa: ANN202
        """Run ``tokens`` more on ``w``'s batch; returns the Seq (``first_at`` set)."""
        assert w.decode is not None
        seq = Seq(max(tokens, 0.0), context, self.env.event())
        if tokens <= 0:
            seq.first_at = self.env.now
            return seq
        w.decode.add(seq, extra_s)
        yield seq.done
        return seq

    def _pd(self, conv: int, turn: Turn, rec: Record):  # noqa: ANN202
        """pd_wan / pd_local: the blocks D's DRC lacks to D, D emits every token."""
        p = self.workers[rec.decision.worker(Role.PREFILL)]
        d = self.workers[rec.decision.decoder]
        assert d.cache is not None and d.decode is not None
        yield from self.prefill_stage(p, conv, turn, rec)
        self.release(rec, p)
        n, prof = turn.prompt_tokens, d.profile
        have = d.cache.cached_tokens(conv, n)  # what D holds when the send starts
        nbytes = (n // prof.block_size * prof.block_size - have) * prof.kv_bytes_per_token
        if self.fleet.mode is RouterMode.PD_WAN:
            t = self.link.send(nbytes)
            yield t.landed
            rec.wan_bytes = nbytes
        else:
            yield self.env.timeout(self.local_s(nbytes))
        pin = land(d, conv, n)
        tail = d.profile.extend_s(n % prof.block_size) if n % prof.block_size else 0.0
        seq = Seq(float(turn.output_tokens), n, self.env.event())
        d.decode.add(seq, tail)
        yield seq.done
        rec.first_at = seq.first_at
        finish(d, conv, n + turn.output_tokens, pin)

    # --- KV still crossing after RLD ended its request (pdd.router.fleet.deferred) ----------

    def defer(self, md: Worker, conv: int, have: int, tokens: int, t: Transfer,
              rec: Record) -> None:  # fmt: skip
        """``t`` (MD's KV of ``tokens`` prompt tokens, ``have`` of them cached when it
        started) goes on behind every other transfer until P's send deadline; MD's cache gets
        the prompt when it lands. Its bytes are the request's, added when it ends."""
        self.link.defer(t)
        key = (md.id, conv)
        d = self.deferred[key] = _Deferred(md, conv, t, have, t.sent, rec)

        def landed(_e: object) -> None:
            if self.deferred.get(key) is d:
                del self.deferred[key]
            assert md.cache is not None
            md.cache.store(conv, tokens)
            self.log.wan[rec.log_index] += t.nbytes - d.sent_then

        t.landed.callbacks.append(landed)
        left = t.started + self.settings.policy.send_kv_deadline_s - self.env.now
        self.env.timeout(max(left, 0.0)).callbacks.append(lambda _e: self._cut(key, d))

    def supersede(self, md: Worker, conv: int) -> None:
        """A request of the conversation reached ``md``: its own transfer (or computation)
        covers what a deferred one still carries, so that one is cut."""
        key = (md.id, conv)
        d = self.deferred.get(key)
        if d is not None:
            self._cut(key, d)

    def _cut(self, key: tuple[str, int], d: _Deferred) -> None:
        """Cut a deferred transfer still crossing; MD keeps the whole blocks that crossed
        (partial landing)."""
        t = d.transfer
        if self.deferred.get(key) is not d or t.landed.triggered:
            return  # it ended already, or its last byte left: it lands
        del self.deferred[key]
        self.link.cancel(t)
        bs, kvb = d.md.profile.block_size, d.md.profile.kv_bytes_per_token
        crossed = int(t.sent // (bs * kvb)) * bs
        if crossed:
            assert d.md.cache is not None
            d.md.cache.store(d.conv, d.have + crossed)
        self.log.wan[d.rec.log_index] += t.sent - d.sent_then

    def local_s(self, nbytes: int) -> float:
        return self.settings.local_rtt_s / 2 + nbytes * 8 / self.settings.local_bandwidth_bps


@dataclass(eq=False)
class Record:
    arrival: float
    decision: Decision
    workers: list[Worker]  # the decision's, in its order
    first_at: float | None = None
    rld_tokens: int = 0
    wan_bytes: int = 0
    p_wait: float = 0.0
    handoff: str = HandoffMode.NONE.value
    released: dict[str, float] = field(default_factory=dict)
    log_index: int = -1  # its row in the RequestLog, once it ended

    @property
    def pipeline(self) -> str:
        return self.decision.pipeline.value


@dataclass(eq=False, slots=True)
class _Deferred:
    md: Worker
    conv: int
    transfer: Transfer
    have: int  # prompt tokens MD held when it started
    sent_then: float  # bytes the request was credited with when RLD ended it
    rec: Record


_AFFINE = (Pipeline.PD, Pipeline.COLOCATED)


def _cached(workers: list[Worker], conv: int, tokens: int) -> dict[str, int]:
    out = {}
    for w in workers:
        if w.cache is not None:
            n = w.cache.cached_tokens(conv, tokens)
            if n:
                out[w.id] = n
    return out


def _mean_final_context(workload: Workload) -> float:
    turns = [t for c in workload.conversations for t in c.turns]
    return sum(t.prompt_tokens + t.output_tokens for t in turns) / max(len(turns), 1)
