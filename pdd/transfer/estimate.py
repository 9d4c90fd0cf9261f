"""Live link estimates (bandwidth, RTT) per peer, and the chunk-size policy built on them.

Bandwidth is the goodput of acknowledged bytes measured only while the link is busy (at least
one chunk unacknowledged), over intervals of at least `interval_s`, smoothed with an EWMA:
idle time never drags the estimate down. RTT is the kernel's minimum RTT of the streams
(TCP_INFO tcpi_min_rtt), so it excludes our own queueing. The router reads these through
`TcpTransport.link_estimates()`.
"""

from __future__ import annotations

import threading

from pdd.config.transfer import TransferConfig
from pdd.transfer.api import LinkEstimate

LAN_RTT_S = 0.001  # below this a path is treated as local: chunks need not shrink for cancel


class LinkEstimator:
    """Thread-safe; fed by every stream of one peer link."""

    def __init__(self, alpha: float = 0.3, interval_s: float = 0.05):
        self._lock = threading.Lock()
        self._alpha = alpha
        self._interval = interval_s
        self._bw_bps = 0.0
        self._rtt_s = 0.0
        self._samples = 0
        self._inflight = 0
        self._t0 = 0.0
        self._bytes = 0

    def on_send(self, nbytes: int, now: float) -> None:
        with self._lock:
            if self._inflight == 0:  # a busy period starts
                self._t0, self._bytes = now, 0
            self._inflight += max(nbytes, 1)

    def on_ack(self, nbytes: int, now: float) -> None:
        with self._lock:
            self._inflight = max(0, self._inflight - max(nbytes, 1))
            self._bytes += nbytes
            elapsed = now - self._t0
            if elapsed >= self._interval or (self._inflight == 0 and elapsed > 0.005):
                self._sample(self._bytes * 8 / max(elapsed, 1e-6))
                self._t0, self._bytes = now, 0

    def _sample(self, bps: float) -> None:
        if self._samples == 0:
            self._bw_bps = bps
        else:
            self._bw_bps += self._alpha * (bps - self._bw_bps)
        self._samples += 1

    def on_rtt(self, rtt_s: float) -> None:
        if rtt_s <= 0:
            return
        with self._lock:
            self._rtt_s = rtt_s if self._rtt_s == 0 else min(self._rtt_s, rtt_s)

    def estimate(self) -> LinkEstimate | None:
        with self._lock:
            if self._rtt_s == 0 and self._samples == 0:
                return None
            return LinkEstimate(self._bw_bps, self._rtt_s, self._samples)


def chunk_bytes_for(est: LinkEstimate | None, streams: int, config: TransferConfig) -> int:
    """Largest chunk a stream can send in max(RTT/2, chunk_time_floor_s) on a WAN.

    A cancel waits for at most the chunk each stream is sending plus a bounded kernel queue,
    so this keeps "bytes stop within ~2 RTTs". On a LAN (base RTT under 1 ms) chunks are as
    large as allowed: per-chunk overhead, not cancel latency, is what matters there, and a
    bandwidth estimate limited by that overhead must not shrink chunks further.
    """
    lo, hi = config.min_chunk_bytes, config.chunk_bytes
    if est is None or est.rtt_s == 0:
        return lo
    if est.rtt_s < LAN_RTT_S:  # a LAN: one largest chunk per stream drains in milliseconds
        return hi
    if est.samples == 0:
        return lo
    per_stream_bytes_s = est.bandwidth_bps / 8 / max(1, streams)
    budget_s = max(est.rtt_s / 2, config.chunk_time_floor_s)
    target = int(per_stream_bytes_s * budget_s) & ~0xFFFF  # whole 64 KiB units
    return max(lo, min(hi, target))
