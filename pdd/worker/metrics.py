"""Prometheus metrics of one worker, served on its own /metrics HTTP port.

Owns: the worker's metric families and the metrics HTTP server. Engine gauges are read from
``Engine.stats()`` at scrape time (no polling task); request outcomes are counted by the
service. vLLM's own ``vllm:*`` metrics live in the same default registry and are served too.
Labels are bounded: role and outcome only, never request ids.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdd.engine.types import EngineStats

OUTCOMES = ("stop", "length", "abort", "error", "rejected", "cancelled")


class _EngineCollector(Collector):
    """Turns one EngineStats snapshot into metric families on every scrape."""

    def __init__(self, role: str, snapshot: Callable[[], EngineStats | None]) -> None:
        self._role = role
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        ready = GaugeMetricFamily("pdd_worker_ready", "1 when the engine serves.", labels=["role"])
        ready.add_metric([self._role], 0.0 if s is None else 1.0)
        yield ready
        if s is None:
            return
        gauges = [
            ("pdd_worker_running_requests", "Requests being generated.", s.running),
            ("pdd_worker_waiting_requests", "Requests waiting for the scheduler.", s.waiting),
            ("pdd_worker_kv_cache_usage_ratio", "Fraction of KV blocks in use.", s.kv_cache_usage),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["role"])
            g.add_metric([self._role], value)
            yield g
        counters = [
            ("pdd_worker_prefix_cache_queries", "Prompt tokens looked up.", s.prefix_cache_queries),
            ("pdd_worker_prefix_cache_hits", "Prompt tokens found cached.", s.prefix_cache_hits),
            ("pdd_worker_generation_tokens", "Tokens generated.", s.generated_tokens),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["role"])
            c.add_metric([self._role], value)
            yield c


class WorkerMetrics:
    """Registers the worker's metrics in the default registry; ``serve`` starts /metrics."""

    def __init__(self, role: str, snapshot: Callable[[], EngineStats | None]) -> None:
        self._collector = _EngineCollector(role, snapshot)
        REGISTRY.register(self._collector)
        self._requests = Counter(
            "pdd_worker_requests",
            "Generate requests by how they ended.",
            ["role", "outcome"],
        )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def request_done(self, role: str, outcome: str) -> None:
        self._requests.labels(role, outcome if outcome in OUTCOMES else "error").inc()

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server (daemon thread); returns the bound port."""
        self._server, self._thread = start_http_server(port, addr=host)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        REGISTRY.unregister(self._collector)
        REGISTRY.unregister(self._requests)
