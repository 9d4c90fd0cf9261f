"""Fixtures for the benchmark tests: token models (the estimator always; the default model's
tokenizer when it is prepared)."""

from __future__ import annotations

import pytest

from pdd.bench.serve.tokens import EstimatedTokens, ModelTokens
from pdd.config import ModelConfig


@pytest.fixture(scope="session")
def estimate() -> EstimatedTokens:
    return EstimatedTokens(1.3)


@pytest.fixture(scope="session")
def model_tokens() -> ModelTokens:
    path = ModelConfig().resolved_path()
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"default model folder {path} is missing: run `make model` (make test does)")
    return ModelTokens(path)
