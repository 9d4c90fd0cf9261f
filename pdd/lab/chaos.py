"""What the lab's WAN does to each packet beyond a fixed delay: the chaos options of LabConfig.

Pure (a clock value and a seeded ``random.Random`` in, decisions out), so the relay's packet
loop stays mechanism and every effect is unit-tested without namespaces:

    outage   the link is down for flap_down_s once every flap_every_s (both directions:
             one schedule, shared by the two delay lines); a packet sent meanwhile is lost
    rate     rate_factors[k] x rate_mbit during the k-th rate_change_every_s (cycling); the
             relay paces packets at that rate (the kernel's tbf runs at the highest factor)
    loss     per direction (loss_b_to_a for dc-b -> dc-a when set)
    jitter   up to jitter_ms more one-way delay, uniform; order kept (a packet never leaves
             before the one ahead of it) unless it is reordered
    reorder  held back reorder_ms longer, so the packets behind it overtake it
    duplicate delivered twice

Time is the relay's monotonic clock, counted from the relay's start (``t0``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdd.config.lab import LabConfig


class Schedule:
    """The link-wide timeline: outages and rate factors (one per lab, both directions)."""

    def __init__(self, cfg: LabConfig, t0: float, rng: random.Random) -> None:
        self.cfg, self.t0, self.rng = cfg, t0, rng
        self._outages: list[tuple[float, float]] = []  # (start, end), one per flap period

    def link_up(self, now: float) -> bool:
        every = self.cfg.flap_every_s
        if not every:
            return True
        k = int((now - self.t0) // every)
        while len(self._outages) <= k:  # draw each period's outage once, in order
            start = self.t0 + (len(self._outages) + 1) * every - self.cfg.flap_down_s[1]
            lo, hi = self.cfg.flap_down_s
            self._outages.append((start, start + self.rng.uniform(lo, hi)))
        start, end = self._outages[k]
        return not start <= now < end

    def rate_factor(self, now: float) -> float:
        factors = self.cfg.rate_factors
        if not factors:
            return 1.0
        return factors[int((now - self.t0) // self.cfg.rate_change_every_s) % len(factors)]

    @property
    def paced(self) -> bool:
        """Whether the relay paces packets itself (a changing rate)."""
        return bool(self.cfg.rate_factors)

    @property
    def tbf_factor(self) -> float:
        """The kernel's rate limit, as a factor of rate_mbit: the fastest the link ever runs."""
        return max(self.cfg.rate_factors, default=1.0)


@dataclass(frozen=True, slots=True)
class Verdict:
    copies: int  # 0: lost
    extra_delay_s: float  # beyond delay_ms and the pacing
    keep_order: bool  # may not leave before the packet ahead of it


class PacketChaos:
    """Per-packet decisions of one direction."""

    def __init__(self, cfg: LabConfig, reverse: bool, schedule: Schedule, rng: random.Random):
        self.cfg, self.schedule, self.rng = cfg, schedule, rng
        loss = cfg.loss_b_to_a if reverse and cfg.loss_b_to_a is not None else cfg.loss
        self.loss = loss

    def verdict(self, now: float) -> Verdict:
        cfg, rng = self.cfg, self.rng
        if not self.schedule.link_up(now) or (self.loss and rng.random() < self.loss):
            return Verdict(0, 0.0, True)
        extra = rng.uniform(0, cfg.jitter_ms) / 1000 if cfg.jitter_ms else 0.0
        reordered = bool(cfg.reorder) and rng.random() < cfg.reorder
        if reordered:
            extra += cfg.reorder_ms / 1000
        copies = 2 if cfg.duplicate and rng.random() < cfg.duplicate else 1
        return Verdict(copies, extra, not reordered)


def chaos_summary(cfg: LabConfig) -> str:
    """The chaos options in force, for logs and status ("" when none is)."""
    parts = []
    if cfg.loss_b_to_a is not None:
        parts.append(f"loss b->a {cfg.loss_b_to_a}")
    if cfg.jitter_ms:
        parts.append(f"jitter {cfg.jitter_ms} ms")
    if cfg.reorder:
        parts.append(f"reorder {cfg.reorder} (+{cfg.reorder_ms} ms)")
    if cfg.duplicate:
        parts.append(f"duplicate {cfg.duplicate}")
    if cfg.flap_every_s:
        lo, hi = cfg.flap_down_s
        parts.append(f"down {lo}-{hi} s every {cfg.flap_every_s} s")
    if cfg.rate_factors:
        parts.append(f"rate x{list(cfg.rate_factors)} every {cfg.rate_change_every_s} s")
    return ", ".join(parts)
