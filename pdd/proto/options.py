"""gRPC options the router's channels and the workers' servers must agree on.

Keepalive: while a call is open the router pings the worker every ``KEEPALIVE_S`` and drops the
connection when a ping goes unanswered for ``KEEPALIVE_TIMEOUT_S``. A worker that vanishes
without closing its sockets (host down, WAN partition) then fails its open Generate streams
with UNAVAILABLE within ~10 s, so the router's recovery takes over, instead of the stream
stalling until the request's deadline. Workers accept those pings even while a stream sends no
data (a decode stall, a long prefill): without that, gRPC's defaults would answer the third
ping with GOAWAY ("too_many_pings") and kill healthy streams.

Reconnects: a channel whose worker cannot be reached tries again at growing intervals, by
gRPC's default up to 120 s apart. After a WAN partition, or a link so congested that every
connect attempt timed out, the router would then not see a healed MD for up to two minutes;
pdd caps the interval at ``MAX_RECONNECT_BACKOFF_S``.
"""

from __future__ import annotations

KEEPALIVE_S = 5.0
KEEPALIVE_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_RECONNECT_BACKOFF_S = 5.0

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),  # a silent stream is still pinged
    ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.initial_reconnect_backoff_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000)),
    # each channel owns its connections: a worker's new channel (re-registered, re-addressed)
    # never inherits the state of a closed one's shared subchannel
    ("grpc.use_local_subchannel_pool", 1),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_S * 1000 / 2)),
    ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging
]
