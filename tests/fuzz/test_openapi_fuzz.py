"""Schemathesis fuzzes every operation of the router's /openapi.json over real HTTP.

The router is the real app (uvicorn) wired to one fake gRPC worker (tests.router.harness).
Hypothesis generates valid and invalid bodies and parameters for each operation; the oracle
is "never a 5xx": every bad input must be refused with a 4xx (OpenAI's error shape), and
every accepted one answered. Bounded: at most MAX_EXAMPLES per mode and operation, and no
more requests once the module has fuzzed for BUDGET_S (a loaded CI machine stays under a
minute); afterwards the router must still serve a normal request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import BaseSchema, Case, GenerationMode
from schemathesis.checks import not_a_server_error

from pdd.config import ModelConfig
from pdd.router.http.routes import router as api_routes
from pdd.router.text.tokenizer import TextCodec
from tests.router.harness import RouterHarness

MAX_EXAMPLES = 100
BUDGET_S = 40.0
MODEL = "SmolLM2-135M-Instruct"
OPERATIONS = sorted(
    (method, route.path_format)  # as OpenAPI writes it: "{model:path}" is "{model}"
    for route in api_routes.routes
    for method in route.methods  # type: ignore[attr-defined]
)  # every endpoint the router defines, including ones added later


@pytest.fixture(scope="module")
def fuzz_router() -> Iterator[RouterHarness]:
    path = ModelConfig().resolved_path()
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"default model folder {path} is missing: run `make model` (make test does)")
    # Hypothesis shares this process (and the GIL) with the router: generous control-RPC
    # deadlines keep a busy moment from marking the fake worker unhealthy (a correct 503).
    h = RouterHarness(TextCodec.from_folder(path), worker_rpc_timeout_s=10.0, health_interval_s=0.5)
    h.start()
    h.fuzz_until = time.monotonic() + BUDGET_S  # type: ignore[attr-defined]
    yield h
    h.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_router: RouterHarness) -> BaseSchema:
    return schemathesis.openapi.from_url(fuzz_router.root + "/openapi.json", timeout=10)


def test_openapi_lists_every_operation(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"
]  # the GETs take no input, so nothing can violate their schema


# schemathesis' own pytest plugin does not run under pytest 9, so each operation is one
# plain hypothesis test here: schema-conforming input, and (for bodies) violating input.
@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_no_input_makes_a_server_error(api_schema, fuzz_router, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode), served_model=st.booleans())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Case, served_model: bool) -> None:
        if time.monotonic() > fuzz_router.fuzz_until:
            return  # out of budget: the remaining examples pass without a request
        if served_model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # else nearly every body stops at the 404 model check
        case.call_and_validate(base_url=fuzz_router.root, checks=[not_a_server_error], timeout=10)

    fuzz()


def test_router_still_serves_after_fuzzing(fuzz_router):
    fuzz_router.reset()
    assert httpx.get(fuzz_router.root + "/health", timeout=10).status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(fuzz_router.url + "/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    in_flight = httpx.get(fuzz_router.root + "/debug/workers", timeout=10).json()["in_flight"]
    assert in_flight == 0
