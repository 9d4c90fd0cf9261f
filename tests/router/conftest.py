"""Fixtures for router tests: the default model's tokenizer, and a router wired to a fake
worker (module-scoped; the fake's script is reset before each test)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdd.config import ModelConfig
from pdd.router.text.tokenizer import TextCodec
from tests.router.harness import RouterHarness


@pytest.fixture(scope="session")
def codec() -> TextCodec:
    path = ModelConfig().resolved_path()
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"default model folder {path} is missing: run `make model` (make test does)")
    return TextCodec.from_folder(path)


@pytest.fixture(scope="module")
def harness(codec: TextCodec) -> Iterator[RouterHarness]:
    h = RouterHarness(codec)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def router(harness: RouterHarness) -> Iterator[RouterHarness]:
    """The shared router with a fresh fake-worker script; checks nothing is left running."""
    harness.reset()
    yield harness
    wait_until(lambda: not harness.fake.running, "fake worker still has running requests")


PDD_POLICY = {
    "ttft_budget_s": 0.5,
    "await_kv_poll_s": 0.05,
    "await_kv_timeout_s": 10.0,
    "kv_in_wait_s": 5.0,
    "catch_up_threshold_tokens": 4,
    "max_catch_up_rounds": 8,
}


@pytest.fixture(scope="module")
def pdd_harness(codec: TextCodec) -> Iterator[RouterHarness]:
    """Router in mode pdd with fake P (p0), RLD (rld0), MD (md0) on one fake KV plane."""
    h = RouterHarness.pdd(codec, "pdd", **PDD_POLICY)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def pdd(pdd_harness: RouterHarness) -> Iterator[RouterHarness]:
    """Fresh scripts and an empty MD cache; afterwards, checks that nothing is left anywhere."""
    fresh(pdd_harness)
    yield pdd_harness
    assert_released(pdd_harness)


def fresh(h: RouterHarness) -> None:
    h.reset()
    h.wait_all_healthy()
    h.wait_drc_synced()


def assert_released(h: RouterHarness) -> None:
    """No fake runs a request or holds KV; the router counts nothing in flight; every
    continuation a fake was asked for was exactly prompt + emitted tokens."""
    wait_until(lambda: not any(f.running for f in h.fakes), "a fake still runs a request")
    assert h.plane is not None
    wait_until(lambda: not h.plane.held(), f"KV still held: {h.plane.held()}")
    wait_until(lambda: all(w["in_flight"] == 0 for w in h.workers()), "router still counts load")
    assert [v for f in h.fakes for v in f.violations] == []


def wait_until(predicate, message: str, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(message)
