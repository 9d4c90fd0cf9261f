"""PddConnector P -> D in bfloat16 (the default dtype): byte-exact blocks, equal greedy tokens.

A module of its own so that its two engines start only after test_connector.py's fp32 pair
has stopped (module-scoped fixtures end with their module).
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.engine.connector_params import LoadParams, wrap
from tests.engine.test_connector import Shell, export, prompt_of, run, start_pair, wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def shell():
    shell = Shell("bfloat16", num_slots=16)
    yield shell
    shell.close()


@pytest.fixture(scope="module")
def engines(loop, shell):
    p = d = None
    try:
        p, d = start_pair(loop, shell, "bfloat16")
        yield p, d
    finally:
        for engine in (d, p):
            if engine is not None:
                loop.run_until_complete(engine.stop())


def test_bf16_d_decodes_from_p_kv_like_a_single_engine(loop, engines, shell):
    p, d = engines
    prompt = prompt_of(11, 450)
    slots = [15 - i for i in range(14)]
    _, exported = export(loop, shell, p, "p-bf", prompt, slots)
    assert (exported["num_blocks"], exported["complete"]) == (14, True)
    want, _ = run(loop, p, "base-bf", prompt, 12)
    got, last = run(loop, d, "d-bf", prompt, 12, wrap(load=LoadParams(slots=slots)))
    assert got == want
    assert last.num_cached_tokens == 448
    wait_idle(loop, d)
