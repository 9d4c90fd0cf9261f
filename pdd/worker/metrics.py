"""Prometheus metrics of one worker, served on its own HTTP port with a /health probe.

Owns: the worker's metric families and the HTTP server (``/metrics``: Prometheus text;
``/health``: 200 "ok" when the worker serves, 503 while it starts or drains, for Kubernetes
probes). Engine gauges and the KV plane are read at scrape time (no polling task) from
``Engine.stats()`` and the role's ``kv_stats()``; request outcomes are counted by the service.
vLLM's own ``vllm:*`` metrics live in the same default registry and are served too. Labels are
bounded: role and outcome only, never request ids.

Lifecycle: ``WorkerMetrics(...)`` registers the families -> ``serve`` (before the engine
starts, so probes get 503 rather than a refused connection) -> ``close``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import REGISTRY, Counter, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler
from prometheus_client.registry import Collector

from pdd.engine.types import EngineStats
from pdd.protocol import Role
from pdd.worker.roles import KvStats

OUTCOMES = ("stop", "length", "abort", "error", "rejected", "cancelled")


def _families(role: str, kind, rows: Iterable[tuple[str, str, float]]) -> Iterator[Metric]:
    for name, doc, value in rows:
        family = kind(name, doc, labels=["role"])
        family.add_metric([role], value)
        yield family


class _EngineCollector(Collector):
    """Turns one EngineStats and one KvStats snapshot into metric families on every scrape."""

    def __init__(
        self,
        role: str,
        snapshot: Callable[[], EngineStats | None],
        kv: Callable[[], KvStats | None],
    ) -> None:
        self._role = role
        self._snapshot = snapshot
        self._kv = kv

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield from _families(
            self._role,
            GaugeMetricFamily,
            [("pdd_worker_ready", "1 when the engine serves.", 0.0 if s is None else 1.0)],
        )
        if s is None:
            return
        gauges = [
            ("pdd_worker_running_requests", "Requests being generated.", s.running),
            ("pdd_worker_waiting_requests", "Requests waiting for the scheduler.", s.waiting),
            ("pdd_worker_kv_cache_usage_ratio", "Fraction of KV blocks in use.", s.kv_cache_usage),
        ]
        counters = [
            ("pdd_worker_prefix_cache_queries", "Prompt tokens looked up.", s.prefix_cache_queries),
            ("pdd_worker_prefix_cache_hits", "Prompt tokens found cached.", s.prefix_cache_hits),
            ("pdd_worker_generation_tokens", "Tokens generated.", s.generated_tokens),
        ]
        kv = self._kv()
        if kv is not None:
            gauges += _kv_gauges(kv)
            counters += _kv_counters(kv)
        yield from _families(self._role, GaugeMetricFamily, gauges)
        yield from _families(self._role, CounterMetricFamily, counters)


def _kv_gauges(kv: KvStats) -> list[tuple[str, str, float]]:
    rows = [
        ("pdd_worker_kv_pinned_slots", "Arena/DRC slots pinned by requests or transfers.",
         kv.pinned_slots),
        ("pdd_worker_kv_arena_blocks", "KV arena size (P: staging slots, RLD: landing slots, "
         "MD: DRC blocks).", kv.arena_blocks),
        ("pdd_worker_kv_free_blocks", "Arena blocks a new request can have now (MD: free + "
         "evictable + kept landings' slots); the router routes by it.", kv.free_blocks),
        ("pdd_worker_kv_open_transfers", "KV transfers (in + out) not yet terminal.",
         kv.open_transfers),
        ("pdd_worker_wan_bandwidth_bps", "Live WAN bandwidth estimate toward MD (bits/s).",
         kv.wan_bandwidth_bps),
        ("pdd_worker_wan_rtt_seconds", "Live WAN round-trip estimate toward MD.", kv.wan_rtt_s),
    ]  # fmt: skip
    if kv.drc is not None:
        rows += [
            ("pdd_drc_capacity_blocks", "Slots of the DRC host tier.", kv.drc.capacity_blocks),
            ("pdd_drc_used_blocks", "Blocks cached in the DRC.", kv.drc.committed_blocks),
            ("pdd_drc_landing_blocks", "DRC slots reserved for blocks landing.",
             kv.drc.landing_blocks),
            ("pdd_worker_md_sessions", "Catch-Up sessions MD holds open (their KV stays in "
             "the engine between calls).", kv.md_sessions),
        ]  # fmt: skip
    return rows


def _kv_counters(kv: KvStats) -> list[tuple[str, str, float]]:
    rows = [
        ("pdd_worker_kv_sent_bytes", "KV bytes sent (acknowledged).", kv.kv_bytes_sent),
        ("pdd_worker_kv_received_bytes", "KV bytes received.", kv.kv_bytes_received),
        ("pdd_worker_kv_refused_chunks", "Inbound KV chunks refused: not in this worker's "
         "KV geometry, or without their reservation's landing key.", kv.kv_refused_chunks),
    ]  # fmt: skip
    if kv.drc is not None:
        rows += [
            ("pdd_drc_query_tokens", "Prompt tokens looked up in the DRC (PrepareKv).",
             kv.drc_query_tokens),
            ("pdd_drc_hit_tokens", "Of those, tokens the DRC held.", kv.drc_hit_tokens),
            ("pdd_worker_kv_in_waits", "Generate calls that waited for their inbound KV.",
             kv.kv_in_waits),
            ("pdd_worker_own_blocks_stored", "Blocks MD's engine copied into the DRC after "
             "requests finished (blocks it computed that the DRC lacked).",
             kv.own_blocks_stored),
            ("pdd_drc_evicted_blocks", "Blocks evicted from the DRC (LRU).",
             kv.drc.evicted_blocks),
            ("pdd_worker_md_session_turns", "Catch-Up calls that continued a session MD held "
             "open (they computed only the tokens emitted since).", kv.md_session_turns),
        ]  # fmt: skip
    return rows


class WorkerMetrics:
    """Registers the worker's metrics in the default registry; ``serve`` starts the HTTP port."""

    def __init__(
        self,
        role: str,
        snapshot: Callable[[], EngineStats | None],
        kv: Callable[[], KvStats | None] = lambda: None,
        ready: Callable[[], bool] = lambda: False,
    ) -> None:
        self._collector = _EngineCollector(role, snapshot, kv)
        REGISTRY.register(self._collector)
        self._requests = Counter(
            "pdd_worker_requests",
            "Generate requests by how they ended.",
            ["role", "outcome"],
        )
        self._prompt_tokens = Counter(
            "pdd_worker_prompt_tokens_received",
            "Prompt token ids received, by RPC: a Generate that refers to the prompt its "
            "PrepareKv brought (prompt_ref) counts only the tokens after it.",
            ["role", "rpc"],
        )
        self._prompt_refs = Counter(
            "pdd_worker_prompt_refs",
            "Generates that referred to a PrepareKv's prompt: resolved, or missing (the "
            "worker no longer held it; the router resent the prompt whole).",
            ["role", "outcome"],
        )
        # every series the role can move, from zero (rate() sees the first increment)
        receives_kv = role in (Role.RELAY_DECODE, Role.MAIN_DECODE)
        for rpc in ("Generate", "PrepareKv") if receives_kv else ("Generate",):
            self._prompt_tokens.labels(role, rpc)
        for outcome in ("resolved", "missing") if receives_kv else ():
            self._prompt_refs.labels(role, outcome)
        self.ready = ready
        self.insecure: list[str] = []  # credentials security.insecure let this worker lack
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def request_done(self, role: str, outcome: str) -> None:
        self._requests.labels(role, outcome if outcome in OUTCOMES else "error").inc()

    def prompt_received(self, role: str, rpc: str, tokens: int) -> None:
        self._prompt_tokens.labels(role, rpc).inc(tokens)

    def prompt_ref(self, role: str, resolved: bool) -> None:
        self._prompt_refs.labels(role, "resolved" if resolved else "missing").inc()

    def serve(self, host: str, port: int) -> int:
        """Start /metrics and /health (daemon thread); returns the bound port."""
        metrics_app = make_wsgi_app(REGISTRY)

        def app(environ, start_response):
            if environ.get("PATH_INFO") == "/health":
                ok = self.ready()
                status = "200 OK" if ok else "503 Service Unavailable"
                start_response(status, [("Content-Type", "text/plain")])
                body = b"ok\n" if ok else b"not ready\n"
                if self.insecure:
                    body += ("insecure: without " + "; ".join(self.insecure) + "\n").encode()
                return [body]
            # Always the classic text format: with OpenMetrics (what Prometheus asks for)
            # prometheus_client renames vLLM's `vllm:*` samples, and dashboards miss them.
            environ = {k: v for k, v in environ.items() if k != "HTTP_ACCEPT"}
            return metrics_app(environ, start_response)

        family, addr = _get_best_family(host, port)

        class Server(ThreadingWSGIServer):
            address_family = family

        server = make_server(addr, port, app, Server, handler_class=_SilentHandler)
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for owned in (self._collector, self._requests, self._prompt_tokens, self._prompt_refs):
            REGISTRY.unregister(owned)
