"""Live link estimates (bandwidth, RTT) per peer, and the sending plan built on them.

Bandwidth is the goodput of acknowledged bytes measured only while the link is busy (at least
one chunk unacknowledged), over intervals of at least `interval_s`: the intervals' bytes and
their seconds are smoothed apart (EWMA) and divided, so each interval weighs by its length.
Idle time never drags the estimate down. A busy period's clock starts at its first ack, not
its first send: the trip before it delivers nothing, and counting it made the first sample of
each transfer (which the EWMA keeps for several more) read low by up to an RTT per interval.
RTT is the kernel's minimum RTT of the streams (TCP_INFO tcpi_min_rtt), so it excludes our
own queueing. The router reads these through `TcpTransport.link_estimates()`.

The plan of a WAN link (``plan_flow``, pure): how many streams, what chunk size and how many
unacknowledged chunks per stream, so the bytes in flight cover the path's bandwidth-delay
product (BDP)::

    start         wan_streams x window_chunks chunks (no estimate yet)
    in flight     max(start, WINDOW_HEADROOM x the bytes of one chunk loop), at most
                  max_inflight_bytes. A chunk's loop, from its send to its ack, is about
                  CHUNK_LOOP_RTTS = 2 RTTs, not one: its trip, its own time on the wire (a
                  chunk is acked only once all of it arrived and was checked) and the ack's
                  way back. A link held back by the window measures window / loop as
                  bandwidth, so 2x the loop's bytes (4x the BDP at the minimum RTT) doubles
                  the window each sample (~each RTT) until the path, not pdd, limits it; at
                  2x the BDP the estimate measured its own window and stopped growing
    streams       enough that no socket must hold more than the kernel lets it
                  (``socket_inflight_limit``: half the smaller tcp_wmem / tcp_rmem maximum),
                  from wan_streams up to max_wan_streams; past that the plan names the sysctl
    chunk         chunk_bytes_for (a quarter RTT per stream: a cancel, or a transfer behind
                  others, waits well under an RTT)
    encoders      with a WAN codec each stream's thread encodes its own chunks, so a link
                  also needs enough streams that their encoders outrun it: the raw bytes the
                  measured rate carries (wire rate / the codec's wire ratio), x CODEC_HEADROOM,
                  over the codec's measured encode rate on one core. A link held back by its
                  encoders measures their rate as its bandwidth, so the encoders grow by that
                  headroom per sample until the path, not the codec, limits it; past the
                  host's cores or max_wan_streams the plan names the codec
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from pdd.config.transfer import TransferConfig
from pdd.transfer.api import LinkEstimate

LAN_RTT_S = 0.001  # below this a path is treated as local: chunks need not shrink for cancel
CHUNK_LOOP_RTTS = 2.0  # a chunk's send-to-ack loop, in minimum RTTs (measured on the lab)
WINDOW_HEADROOM = 2.0  # bytes in flight per chunk loop's bytes: room to measure a faster path
DEFAULT_SOCKET_BYTES = 4 * 1024 * 1024  # Linux's default tcp_wmem maximum
CODEC_HEADROOM = 1.5  # encoder capacity per raw byte rate the link carries


class LinkEstimator:
    """Thread-safe; fed by every stream of one peer link."""

    def __init__(self, alpha: float = 0.3, interval_s: float = 0.05):
        self._lock = threading.Lock()
        self._alpha = alpha
        self._interval = interval_s
        self._bw_bps = 0.0
        self._sum_bytes = self._sum_s = 0.0  # smoothed bytes and seconds of the intervals
        self._rtt_s = 0.0
        self._samples = 0
        self._inflight = 0
        self._t0: float | None = None  # when the busy period's measured interval began
        self._bytes = 0

    def on_send(self, nbytes: int, now: float) -> None:
        with self._lock:
            if self._inflight == 0:  # a busy period starts: its clock starts at its first ack
                self._t0 = None
            self._inflight += max(nbytes, 1)

    def on_ack(self, nbytes: int, now: float) -> None:
        with self._lock:
            self._inflight = max(0, self._inflight - max(nbytes, 1))
            if self._t0 is None:  # the first ack: before it the path delivered nothing yet
                self._t0, self._bytes = now, 0
                return
            self._bytes += nbytes
            elapsed = now - self._t0
            if elapsed >= self._interval or (self._inflight == 0 and elapsed > 0.005):
                self._sample(self._bytes, max(elapsed, 1e-6))
                self._t0, self._bytes = now, 0

    def _sample(self, nbytes: int, seconds: float) -> None:
        """Smooth bytes and seconds apart and divide: each interval weighs by its length (a
        mean of rates would weigh a short burst of late acks like a long steady interval)."""
        if self._samples == 0:
            self._sum_bytes, self._sum_s = float(nbytes), seconds
        else:
            self._sum_bytes += self._alpha * (nbytes - self._sum_bytes)
            self._sum_s += self._alpha * (seconds - self._sum_s)
        self._bw_bps = self._sum_bytes * 8 / self._sum_s
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
    """Largest chunk a stream can send in max(RTT/4, chunk_time_floor_s) on a WAN.

    A cancel waits for at most the chunk each stream is sending plus a bounded kernel queue,
    and a transfer submitted behind others waits for the chunk each stream is sending, then
    for its own chunks' time on the wire: a quarter RTT each keeps both well under an RTT (on
    the lab, 1 Gbit/s x 40 ms, a 2-block transfer behind a full-rate 256 MiB one took 75-98 ms
    at RTT/2 and 69-74 ms at RTT/4; its bound, 2 RTTs + its bytes, is 90 ms). On a LAN (base
    RTT under 1 ms) chunks are as large as allowed: per-chunk overhead, not cancel latency, is
    what matters there, and a bandwidth estimate limited by that overhead must not shrink
    chunks further.
    """
    lo, hi = config.min_chunk_bytes, config.chunk_bytes
    if est is None or est.rtt_s == 0:
        return lo
    if est.rtt_s < LAN_RTT_S:  # a LAN: one largest chunk per stream drains in milliseconds
        return hi
    if est.samples == 0:
        return lo
    per_stream_bytes_s = est.bandwidth_bps / 8 / max(1, streams)
    budget_s = max(est.rtt_s / 4, config.chunk_time_floor_s)
    target = int(per_stream_bytes_s * budget_s) & ~0xFFFF  # whole 64 KiB units
    return max(lo, min(hi, target))


@dataclass(frozen=True, slots=True)
class FlowPlan:
    """How one WAN peer link sends now."""

    streams: int
    chunk_bytes: int
    window_chunks: int  # per stream, of chunk_bytes: the window is their bytes
    limited_by: str = ""  # why the plan holds less than a chunk loop's bytes ("": it does not)

    @property
    def stream_window_bytes(self) -> int:
        """Unacknowledged bytes one stream may have, whatever size its chunks were cut to."""
        return self.window_chunks * self.chunk_bytes

    @property
    def inflight_bytes(self) -> int:
        return self.streams * self.stream_window_bytes


def socket_inflight_limit(proc: Path = Path("/proc/sys/net/ipv4")) -> int:
    """Bytes one TCP socket can keep in flight here: half the smaller of the kernel's
    autotuning maxima (tcp_wmem, tcp_rmem; the other half is the kernel's own overhead)."""
    maxima = []
    for name in ("tcp_wmem", "tcp_rmem"):
        try:
            maxima.append(int(_sysctl(proc, name).split()[2]))
        except (ValueError, IndexError):
            maxima.append(DEFAULT_SOCKET_BYTES)
    return max(64 * 1024, min(maxima) // 2)


def idle_restarts_window(proc: Path = Path("/proc/sys/net/ipv4")) -> bool:
    """The kernel drops an idle connection's congestion window (tcp_slow_start_after_idle):
    a warmed-up link then ramps up again at its next transfer."""
    return _sysctl(proc, "tcp_slow_start_after_idle").strip() not in ("0", "")


def _sysctl(proc: Path, name: str) -> str:
    """A sysctl's text under ``proc``; "" when it cannot be read."""
    try:
        return (proc / name).read_text()
    except OSError:
        return ""


def plan_flow(
    est: LinkEstimate | None,
    config: TransferConfig,
    socket_bytes: int,
    codec: CodecLoad | None = None,
) -> FlowPlan:
    """The plan for a link with estimate ``est`` (module doc), whose chunks a codec with
    ``codec``'s measured figures encodes (None: raw). Pure."""
    streams = config.wan_streams
    start = FlowPlan(streams, chunk_bytes_for(est, streams, config), config.window_chunks)
    if est is None or est.samples == 0:
        return start  # nothing measured yet
    encoders, codec_bound = _encoders(est, config, codec)
    if est.rtt_s < LAN_RTT_S:  # a LAN: the starting window is plenty
        streams = max(streams, encoders)
        return FlowPlan(streams, chunk_bytes_for(est, streams, config), config.window_chunks,
                        codec_bound)  # fmt: skip
    loop = est.bandwidth_bps / 8 * est.rtt_s * CHUNK_LOOP_RTTS  # bytes one chunk loop carries
    want = min(max(start.inflight_bytes, int(loop * WINDOW_HEADROOM)), config.max_inflight_bytes)
    needed = math.ceil(want / socket_bytes)
    streams = max(streams, min(needed, config.max_wan_streams), encoders)
    want = min(want, streams * socket_bytes)  # what the kernel lets that many sockets hold
    chunk = chunk_bytes_for(est, streams, config)
    window = max(config.window_chunks, math.ceil(want / (streams * chunk)))
    limited_by = codec_bound
    if want < loop:  # pdd, not the path, would bound the rate
        limited_by = (
            "transfer.max_inflight_bytes"
            if want == config.max_inflight_bytes
            else f"transfer.max_wan_streams ({config.max_wan_streams}) x "
            f"{socket_bytes >> 20} MiB per socket: raise the net.ipv4.tcp_wmem and "
            "tcp_rmem maxima"
        )
    return FlowPlan(streams, chunk, window, limited_by)


@dataclass(frozen=True)
class CodecLoad:
    """What a link's codec costs, as measured: raw bytes one core encodes per second, and
    wire bytes per raw byte."""

    name: str
    encode_bps: float  # raw bytes per CPU second of one encoder thread
    wire_ratio: float


def _encoders(
    est: LinkEstimate, config: TransferConfig, codec: CodecLoad | None
) -> tuple[int, str]:
    """Streams whose encoders outrun the link (module doc), and what bounds them when the
    cores or max_wan_streams do ("" otherwise); 0 when nothing is encoded or measured."""
    if codec is None or codec.encode_bps <= 0:
        return 0, ""
    raw_bps = est.bandwidth_bps / 8 / max(codec.wire_ratio, 1e-3)
    need = math.ceil(raw_bps * CODEC_HEADROOM / codec.encode_bps)
    cap = min(config.max_wan_streams, os.cpu_count() or 1)
    if need <= cap:
        return need, ""
    return cap, (f"the WAN codec {codec.name}: {cap} encoder threads of "
                 f"{codec.encode_bps / 1e9:.2f} GB/s (transfer.max_wan_streams, the cores)")  # fmt: skip
