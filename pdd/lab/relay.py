"""The WAN relay process: carries IP packets between the two WAN TUN devices, late and lossy.

Each direction is a delay line: a packet read from one datacenter's TUN (already paced at the
link rate by that TUN's tbf qdisc) is dropped with probability ``loss``, else written to the
other datacenter's TUN ``delay_ms`` later. Packets keep their order; a delay line holds at
most twice what the link carries in flight (more would mean the rate limit is gone).
The chaos options (pdd.lab.chaos: outages, a changing rate, jitter, reordering, duplicates,
asymmetric loss) decide per packet on top; with a changing rate the relay paces packets
itself, behind a tail-drop queue of the plan's queue_bytes, as a router's would.

Lifecycle: the supervisor (pdd.lab.supervisor) starts it with both TUN fds and waits on it.
SIGTERM stops it. The TUN devices are the relay's: they vanish when it exits, whatever the
cause. If the supervisor dies first, the kernel sends the relay SIGTERM (PR_SET_PDEATHSIG)
and the relay removes the whole lab itself before exiting.

Timing: epoll sleeps in whole milliseconds rounded up; packets due within half a millisecond
are written early, so a delivery is off by at most about half a millisecond either way.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import heapq
import itertools
import logging
import os
import random
import select
import signal
import sys
import time
from pathlib import Path

from pdd.config.lab import LabConfig
from pdd.lab import state, topology
from pdd.lab.chaos import PacketChaos, Schedule, chaos_summary
from pdd.lab.plan import LabPlan

log = logging.getLogger("pdd.lab.relay")

_SLACK_S = 0.0005
_BATCH = 128  # packets read from one TUN before the other direction gets a turn
_PR_SET_PDEATHSIG = 1
_RT_PRIORITY = 10  # SCHED_FIFO, low among RT tasks (kernel threads use 50+)


class _Stop(Exception):
    """Raised by the SIGTERM/SIGINT handler to leave the packet loop at once."""


class DelayLine:
    """One direction of the WAN: read packets from ``src``, write them to ``dst`` later."""

    def __init__(self, name: str, src: int, dst: int, plan: LabPlan, chaos: PacketChaos):
        self.name = name
        self.src, self.dst = src, dst
        self.delay_s = plan.cfg.delay_ms / 1000
        self.chaos = chaos
        self.schedule = chaos.schedule
        self.rate_bytes_s = plan.rate_bytes_s
        self.queue_bytes = plan.queue_bytes
        self.max_bytes = plan.delay_line_bytes + (plan.queue_bytes if self.schedule.paced else 0)
        self.read_size = plan.cfg.mtu + 64
        self.queue: list[tuple[float, int, bytes]] = []  # a heap by due time, then arrival
        self._seq = itertools.count()
        self.held = 0  # bytes in self.queue
        self.last_due = 0.0  # due time of the last in-order packet
        self.tx_free = 0.0  # paced links: when the link can start the next packet
        self.forwarded = self.lost = self.overflowed = self.duplicated = 0

    def pull(self, now: float) -> None:
        """Read what the TUN has (up to a batch) and schedule each packet's delivery."""
        read, src, size = os.read, self.src, self.read_size
        for _ in range(_BATCH):
            try:
                pkt = read(src, size)
            except BlockingIOError:
                return
            verdict = self.chaos.verdict(now)
            if verdict.copies == 0:
                self.lost += 1
                continue
            start = self._paced_start(now, len(pkt)) if self.schedule.paced else now
            if start is None or self.held + verdict.copies * len(pkt) > self.max_bytes:
                self.overflowed += 1
                continue
            due = start + self.delay_s + verdict.extra_delay_s
            if verdict.keep_order:
                due = self.last_due = max(due, self.last_due)
            for _ in range(verdict.copies):
                heapq.heappush(self.queue, (due, next(self._seq), pkt))
                self.held += len(pkt)
            self.duplicated += verdict.copies - 1

    def _paced_start(self, now: float, nbytes: int) -> float | None:
        """When the link, at its current rate, finishes sending this packet; None when the
        queue in front of it is full (tail drop)."""
        rate = self.rate_bytes_s * self.schedule.rate_factor(now)
        start = max(now, self.tx_free)
        if (start - now) * rate > self.queue_bytes:
            return None
        self.tx_free = start + nbytes / rate
        return self.tx_free

    def push(self, now: float) -> None:
        """Write every packet that is due (within the slack) to the destination TUN."""
        queue, write, dst, limit = self.queue, os.write, self.dst, now + _SLACK_S
        while queue and queue[0][0] <= limit:
            pkt = heapq.heappop(queue)[2]
            self.held -= len(pkt)
            write(dst, pkt)
            self.forwarded += 1

    def next_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None

    def summary(self) -> str:
        return (
            f"{self.name}: forwarded {self.forwarded}, lost {self.lost}, "
            f"overflowed {self.overflowed}, duplicated {self.duplicated}"
        )


def forward(lines: list[DelayLine]) -> None:
    """The packet loop: runs until a signal handler raises _Stop."""
    ep = select.epoll()
    by_fd = {}
    for line in lines:
        ep.register(line.src, select.EPOLLIN)
        by_fd[line.src] = line
    monotonic = time.monotonic
    while True:
        dues = [d for d in (line.next_due() for line in lines) if d is not None]
        timeout = max(0.0, min(dues) - monotonic()) if dues else -1
        events = ep.poll(timeout)
        now = monotonic()
        for fd, _ in events:
            by_fd[fd].pull(now)
        for line in lines:
            line.push(now)


def _run_like_a_link() -> None:
    """Take a real-time priority: a link must not wait behind busy engines for the CPU.

    The relay sleeps in epoll between packets and uses a few percent of a core per
    100 Mbit/s; the kernel's RT throttling (95% of each second by default) bounds it anyway.
    Without the privilege it stays a normal process, and the link gets jittery under load.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_RT_PRIORITY))
    except OSError as exc:
        log.warning("no real-time priority (%s): delays will jitter when the CPU is busy", exc)


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdd.lab.relay", description=__doc__)
    p.add_argument("--config", required=True, type=Path, help="LabConfig as JSON")
    p.add_argument("--fd-a", required=True, type=int, help="fd of dc-a's WAN TUN")
    p.add_argument("--fd-b", required=True, type=int, help="fd of dc-b's WAN TUN")
    p.add_argument("--supervisor", required=True, type=int, help="pid of the supervisor")
    p.add_argument("--ready-fd", required=True, type=int, help="pipe: 'ok' once forwarding")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s relay[%(process)d] %(message)s")
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    plan = LabPlan.from_config(LabConfig.model_validate_json(args.config.read_text()))
    rng = random.Random(plan.cfg.chaos_seed)
    schedule = Schedule(plan.cfg, time.monotonic(), rng)
    lines = [
        DelayLine("dc-a -> dc-b", args.fd_a, args.fd_b, plan,
                  PacketChaos(plan.cfg, False, schedule, rng)),
        DelayLine("dc-b -> dc-a", args.fd_b, args.fd_a, plan,
                  PacketChaos(plan.cfg, True, schedule, rng)),
    ]  # fmt: skip
    _run_like_a_link()
    gc.disable()  # the loop makes no cycles; a collection pause would be link jitter
    log.info("up: delay %.3f ms, loss %.4f, chaos %s", plan.cfg.delay_ms, plan.cfg.loss,
             chaos_summary(plan.cfg) or "off")  # fmt: skip
    try:
        if os.getppid() != args.supervisor:
            raise _Stop("supervisor gone before the relay started")
        os.write(args.ready_fd, b"ok\n")
        os.close(args.ready_fd)
        forward(lines)
    except _Stop as stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish the cleanup below undisturbed
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        log.info("stopping (%s); %s; %s", stop, lines[0].summary(), lines[1].summary())
    finally:
        os.close(args.fd_a)
        os.close(args.fd_b)
    if os.getppid() != args.supervisor:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # not for `ip` children
        log.info("supervisor is gone: removing the lab")
        topology.teardown(plan)
        state.clear(plan)
        log.info("lab %s removed", plan.cfg.prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
