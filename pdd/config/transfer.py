"""KV transfer section (owned by pdd.transfer)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdd.config.base import Section

Codec = Literal["none", "zstd", "lz4", "int8", "int8+zstd", "fp8", "fp8+zstd"]


class TransferConfig(Section):
    """Settings of every transport (UCX inside a datacenter, TCP across the WAN, in-process)."""

    wan_streams: int = Field(4, gt=0, le=64, description="Parallel TCP streams per WAN peer.")
    chunk_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest wire chunk (bytes); one checksum and ack each."
    )
    ucx_chunk_bytes: int = Field(
        16 * 1024 * 1024,
        gt=0,
        description=(
            "UCX chunk (bytes). Inside a datacenter a 16 MiB chunk still moves in ~2 ms and "
            "halves the per-chunk cost of 4 MiB chunks."
        ),
    )
    min_chunk_bytes: int = Field(
        32 * 1024,
        gt=0,
        description="Smallest chunk the TCP transport shrinks to on slow, long links (bytes).",
    )
    chunk_time_floor_s: float = Field(
        0.002,
        gt=0,
        description=(
            "TCP sizes chunks so one takes at most max(RTT/4, this) per stream: a cancel stops "
            "the bytes, and a transfer behind others starts, within an RTT."
        ),
    )
    window_chunks: int = Field(
        4,
        gt=0,
        description="Unacknowledged chunks in flight per TCP stream / per UCX peer (bounds memory). "
        "TCP: the starting window; it grows with the path's bandwidth-delay product.",
    )
    max_wan_streams: int = Field(
        32,
        gt=0,
        le=256,
        description="TCP: most streams per WAN peer. A link whose bandwidth-delay product "
        "exceeds what wan_streams sockets can hold in flight (the kernel's tcp_wmem/tcp_rmem "
        "maxima) opens more, up to this.",
    )
    max_inflight_bytes: int = Field(
        2 * 1024**3,
        gt=0,
        description="TCP: most unacknowledged bytes per WAN peer (chunks reference pinned KV, "
        "so this bounds no copy; 2 GiB covers a chunk loop, 2 RTTs, of 100 Gbit/s at 80 ms).",
    )
    warmup_bytes: int = Field(
        64 * 1024**2,
        ge=0,
        description="TCP: most bytes a link's warm-up probe sends (WarmKv: the router has P "
        "open and measure its link to each MainDecode before the first request). The probe "
        "stops sooner, once the link's bandwidth estimate stops growing, and only ever takes "
        "what real transfers leave of the link. 0: no warm-up (the first transfer ramps up).",
    )
    keep_warm_s: float = Field(
        0.5,
        ge=0,
        description="TCP: an idle WAN stream sends an empty PROBE this often, so its "
        "congestion control's view of the path stays fresh for the next transfer (BBR "
        "re-measures its minimum RTT every 10 s, at 4 packets in flight for 200 ms: better "
        "while idle than at a transfer's start). 0: never.",
    )
    deadline_s: float = Field(60.0, gt=0, description="Default deadline of one transfer.")
    inbound_grace_s: float = Field(
        1.0, ge=0, description="Receiver keeps a transfer this long past the sender's deadline."
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="TCP/UCX connect timeout (s).")
    user_timeout_s: float = Field(
        10.0,
        gt=0,
        description="TCP_USER_TIMEOUT and keepalive: a silent peer is declared dead after this.",
    )
    max_inbound_streams: int = Field(
        256,
        gt=0,
        description="KV receiver: most open sender connections (TCP streams, UCX endpoints); "
        "one more is closed at once (a flood cannot exhaust threads or memory).",
    )
    first_byte_timeout_s: float = Field(
        5.0,
        gt=0,
        description="KV receiver: a connection that has not completed its handshake (TLS, "
        "challenge, proof) within this is closed.",
    )
    listen_host: str = Field("127.0.0.1", description="Address the receiver listens on.")
    listen_port: int = Field(0, ge=0, lt=65536, description="Receiver port; 0 picks a free one.")
    tls: bool = Field(False, description="Encrypt and authenticate TCP streams (mutual TLS).")
    tls_cert_file: str | None = Field(None, description="PEM certificate of this process.")
    tls_key_file: str | None = Field(None, description="PEM private key of this process.")
    tls_ca_file: str | None = Field(
        None, description="PEM CA that signed every peer; peers without such a cert are refused."
    )
    checksum: Literal["xxh3", "crc32c", "crc32", "none"] = Field(
        "xxh3",
        description=(
            "Per-chunk integrity check: xxh3 (~32 GiB/s), crc32c (hardware, ~15 GiB/s), crc32 "
            "(zlib, ~6 GiB/s), each falling back to the next if its package is missing; none "
            "only to measure the check's cost."
        ),
    )
    wan_codec: Codec = Field(
        "none",
        description=(
            "Codec of KV sent over TCP (the WAN, P -> MD): none, zstd or lz4 (lossless, "
            "byte-shuffled), int8 or fp8 (lossy 8-bit codes: keys scaled per channel over a "
            "block, values per token; about half of bfloat16, a quarter of float32), "
            "int8+zstd, fp8+zstd. The receiver decodes whatever each chunk header names. "
            "UCX (P -> RLD) always sends raw."
        ),
    )
    wan_codec_peers: dict[str, Codec] = Field(
        default_factory=dict,
        description=(
            "Per-receiver override of wan_codec, keyed by the receiver's PeerAddress key: its "
            "worker id for pdd workers (e.g. an MD's id), else 'host:port'."
        ),
    )
    ucx_progress_timeout_ms: int = Field(
        1,
        gt=0,
        description=(
            "UCX progress thread epoll timeout; shared-memory transfers need periodic progress."
        ),
    )

    @model_validator(mode="after")
    def _tls_files(self) -> TransferConfig:
        if self.tls and not (self.tls_cert_file and self.tls_key_file and self.tls_ca_file):
            raise ValueError("tls needs tls_cert_file, tls_key_file and tls_ca_file")
        if self.min_chunk_bytes > self.chunk_bytes:
            raise ValueError("min_chunk_bytes must not exceed chunk_bytes")
        if self.max_wan_streams < self.wan_streams:
            raise ValueError("max_wan_streams must not be below wan_streams")
        return self
