"""Drain tests share the router tests' tokenizer fixture (the default model's)."""

from tests.router.conftest import codec  # noqa: F401 (a fixture, used by name)
