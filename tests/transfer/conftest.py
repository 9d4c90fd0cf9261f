"""Fixtures for the transfer suites: transport pairs with a leak check, peer processes."""

from __future__ import annotations

import os
import threading

import pytest

from pdd.config.transfer import TransferConfig
from pdd.transfer import FaultHooks, ReceiverHooks, create_transport
from pdd.transfer.testing import LandingZone, PeerProcess
from tests.transfer.helpers import idle, wait_for

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


class Pair:
    """A receiving and a sending transport of one kind, in this process."""

    def __init__(self, kind, config, zone: LandingZone, faults: FaultHooks, sender_config=None):
        self.kind, self.zone = kind, zone
        self.results: list = []
        self._lock = threading.Lock()
        hooks = ReceiverHooks(zone, on_received=self._on_received)
        self.receiver = create_transport(kind, config, hooks=hooks)
        self.sender = create_transport(kind, sender_config or config, faults=faults)
        self.receiver.start()
        self.sender.start()

    def _on_received(self, result) -> None:
        with self._lock:
            self.results.append(result)

    def result(self, transfer_id: int, timeout_s: float = 10.0):
        def find():
            with self._lock:
                return next((r for r in self.results if r.transfer_id == transfer_id), None)

        return wait_for(find, timeout_s, f"inbound result of {transfer_id}")

    def close(self) -> None:
        self.zone.gate.set()
        for t in (self.sender, self.receiver):
            t.close()


@pytest.fixture
def make_pair(request):
    """`make_pair(kind, **config)`: a started pair; teardown asserts nothing leaked."""

    pairs: list[Pair] = []

    def make(kind: str, zone=None, faults=None, sender: dict | None = None, **cfg):
        """`sender` overrides config fields on the sending side only (e.g. TLS identity)."""
        cfg.setdefault("deadline_s", 30.0)
        sender_config = TransferConfig(**{**cfg, **sender}) if sender else None
        zone, faults = zone or LandingZone(), faults or FaultHooks()
        pair = Pair(kind, TransferConfig(**cfg), zone, faults, sender_config)
        pairs.append(pair)
        return pair

    yield make
    failures = []
    for pair in pairs:
        pair.zone.gate.set()
        for t in (pair.sender, pair.receiver):
            try:
                wait_for(lambda t=t: idle(t), 10, f"{pair.kind} transport to release everything")
            except AssertionError as exc:
                failures.append(f"{exc}: {t.stats()}")
        pair.close()
        for t in (pair.sender, pair.receiver):
            if t.stats().threads != 0:
                failures.append(f"{pair.kind}: threads left after close: {t.stats()}")
    assert not failures, failures


@pytest.fixture
def peers():
    """Start child peer processes; all are stopped (or killed) at teardown."""
    started: list[PeerProcess] = []

    def start(role: str, kind: str, config: dict | None = None, *extra: str) -> PeerProcess:
        p = PeerProcess(role, kind, config, *extra)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
        p.kill()
