"""DNS discovery: a name's address records become workers of one role (``router.fleet.dns``).

For a Kubernetes headless service (``clusterIP: None``) the cluster DNS answers one A/AAAA
record per ready pod, so resolving the service name periodically yields the live workers:

    every interval_s:  resolve(name, port) -> [10.0.1.7, 10.0.1.9]
                       -> workers PREFIX-10.0.1.7, PREFIX-10.0.1.9 (role, port, datacenter
                          from the config entry), pool source "dns:NAME"
                       -> new addresses join the pool, vanished ones are removed

A failed resolution keeps the last answer (a DNS hiccup never empties the fleet); an empty
answer removes every worker of that name (the service has no ready pod). ``sync`` is the
pure part (addresses -> pool changes); ``DnsDiscovery`` owns one task per entry
(``start()`` / ``stop()`` in the app's lifespan). The resolver is a parameter, so tests pass a
fake one; the default uses the event loop's ``getaddrinfo`` (no blocking call on the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from pdd.config import WorkerConfig
from pdd.config.fleet import DnsDiscoveryConfig
from pdd.router.fleet.pool import WorkerPool

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(name: str, port: int) -> list[str]:
    """The distinct addresses ``name`` resolves to (sorted). Raises OSError on failure."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def source_of(entry: DnsDiscoveryConfig) -> str:
    return f"dns:{entry.name}"


def worker_id(entry: DnsDiscoveryConfig, address: str) -> str:
    prefix = entry.id_prefix or entry.name.split(".", 1)[0]
    return f"{prefix}-{address}"


def workers_for(entry: DnsDiscoveryConfig, addresses: Sequence[str]) -> dict[str, WorkerConfig]:
    """The workers one answer stands for."""
    return {
        worker_id(entry, a): WorkerConfig(id=worker_id(entry, a), role=entry.role, host=a,
                                          port=entry.port, datacenter=entry.datacenter)
        for a in addresses
    }  # fmt: skip


def sync(pool: WorkerPool, entry: DnsDiscoveryConfig, addresses: Sequence[str]) -> list[str]:
    """Make the pool's workers of this name match ``addresses``; returns what changed
    (``+id`` joined, ``-id`` left)."""
    source = source_of(entry)
    wanted = workers_for(entry, addresses)
    changes = []
    for gone in sorted(set(pool.members(source)) - set(wanted)):
        pool.remove(gone, f"{entry.name} no longer resolves to it")
        changes.append(f"-{gone}")
    for wid, worker in wanted.items():
        if pool.add(worker, source) != "unchanged":
            changes.append(f"+{wid}")
    return changes


class DnsDiscovery:
    """One resolve loop per configured name."""

    def __init__(
        self,
        pool: WorkerPool,
        entries: Sequence[DnsDiscoveryConfig],
        resolver: Resolver = resolve_dns,
    ):
        self._pool = pool
        self._entries = list(entries)
        self._resolver = resolver
        self._tasks: list[asyncio.Task[None]] = []

    async def refresh(self, entry: DnsDiscoveryConfig) -> list[str]:
        """Resolve once and sync; on a resolver failure nothing changes."""
        try:
            addresses = await asyncio.wait_for(
                self._resolver(entry.name, entry.port), timeout=entry.interval_s
            )
        except (OSError, TimeoutError) as exc:
            log.warning("DNS discovery: %s did not resolve (%s); keeping %d workers",
                        entry.name, exc, len(self._pool.members(source_of(entry))))  # fmt: skip
            return []
        changes = sync(self._pool, entry, addresses)
        if changes:
            log.info("DNS discovery: %s -> %s", entry.name, " ".join(changes))
        return changes

    async def start(self) -> None:
        for entry in self._entries:
            self._tasks.append(asyncio.create_task(self._loop(entry), name=f"pdd-dns-{entry.name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _loop(self, entry: DnsDiscoveryConfig) -> None:
        while True:
            await self.refresh(entry)
            await asyncio.sleep(entry.interval_s)
