"""Fixtures for router tests: the default model's tokenizer, and a router wired to a fake
worker (module-scoped; the fake's script is reset before each test)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdd.config import ModelConfig
from pdd.router.tokenizer import TextCodec
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


def wait_until(predicate, message: str, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(message)
