"""The foundation end to end: `pdd serve` (router + one colocated worker, real vLLM, the default
model) driven by the official OpenAI client, against a direct vLLM run of the same prompts."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest

from pdd.config import load_config
from pdd.proto import worker_pb2, worker_pb2_grpc
from tests.helpers import children_of, run_oracle, serve, stop

pytestmark = pytest.mark.slow

CONFIG = "configs/colocated.yaml"
ORACLE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors of the rainbow:",
    "Once upon a time, in a small village by the sea,",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served():
    s = serve(CONFIG, ["w0"])
    yield s
    pid = s.proc.pid
    code = stop(s)
    assert code == 0, s.log_tail()
    assert children_of(pid) == []


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name():
    return load_config(CONFIG).model.name


def worker_stats(served) -> worker_pb2.StatsResponse:
    port = served.worker_ports["w0"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)


def test_models_lists_the_default_model(client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]


def test_chat_greedy_answers_paris(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client, model_name):
    kwargs = dict(
        model=model_name,
        messages=[{"role": "user", "content": "Name a large animal."}],
        temperature=0,
        max_tokens=20,
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length")


def test_completions_stream_and_non_stream(client, model_name):
    r = client.completions.create(
        model=model_name, prompt="The capital of France is", temperature=0, max_tokens=8
    )
    assert "Paris" in r.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_name,
            prompt="The capital of France is",
            temperature=0,
            max_tokens=8,
            stream=True,
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


@pytest.fixture(scope="module")
def oracle():
    """Greedy tokens of a direct vLLM run, in a separate process (no pdd code)."""
    return run_oracle(ORACLE_PROMPTS, load_config(CONFIG).model.dtype, MAX_TOKENS)


def test_greedy_tokens_equal_direct_vllm(client, model_name, oracle):
    for expected in oracle:
        r = client.completions.create(
            model=model_name,
            prompt=expected["prompt_token_ids"],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        assert r.choices[0].text == expected["text"]
        assert r.usage.completion_tokens == len(expected["token_ids"])
        assert r.usage.prompt_tokens == len(expected["prompt_token_ids"])


BAD_REQUESTS = [
    # (path, body, status, error param or code fragment)
    (
        "/chat/completions",
        {"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]},
        404,
    ),
    (
        "/chat/completions",
        {"model": "$MODEL", "messages": [{"role": "user", "content": "x"}], "n": 0},
        400,
    ),
    (
        "/chat/completions",
        {"model": "$MODEL", "messages": [{"role": "user", "content": "x"}], "temperature": -1},
        400,
    ),
    (
        "/chat/completions",
        {"model": "$MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
        400,
    ),
    ("/chat/completions", {"model": "$MODEL", "messages": "not a list"}, 422),
    ("/chat/completions", {"model": "$MODEL"}, 422),
    ("/completions", {"model": "$MODEL", "prompt": "word " * 5000, "max_tokens": 4}, 400),
    ("/completions", {"model": "$MODEL", "prompt": [10**9], "max_tokens": 4}, 400),
]


def test_bad_inputs_get_openai_errors_and_server_keeps_serving(served, client, model_name):
    with httpx.Client(base_url=served.url, timeout=60) as http:
        for path, body, status in BAD_REQUESTS:
            body = json.loads(json.dumps(body).replace("$MODEL", model_name))
            r = http.post(path, json=body)
            assert r.status_code == status, (path, body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"], r.text
        r = http.post(
            "/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert r.status_code in (400, 422) and "error" in r.json()
        big = b'{"model": "x", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
        r = http.post("/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "error" in r.json()
    r = client.completions.create(model=model_name, prompt="Hello", max_tokens=2)
    assert r.choices[0].text


def test_client_disconnect_aborts_on_worker(served, model_name):
    body = {
        "model": model_name,
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=served.url, timeout=60) as http:
        with http.stream("POST", "/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
        # leaving the block closes the connection mid-stream
    assert worker_stats(served).running_requests in (0, 1)
    deadline = time.monotonic() + 20
    while worker_stats(served).running_requests != 0:
        assert time.monotonic() < deadline, "worker still runs the abandoned request"
        time.sleep(0.2)


def test_pdd_profile_times_served_requests_and_counts_their_shape(served, model_name):
    """`pdd profile`'s served phase against this pdd: a cold prompt hits nothing, the same
    plus two blocks hits its whole blocks, as the server's usage counts them."""
    import asyncio

    from pdd.profiler import Plan, served_ttfts

    block = load_config(CONFIG).engine.block_size
    plan = Plan((64, 128), (1, 2), (1, 8), served=1, served_tokens=200, seed=7)
    cold, warm = asyncio.run(served_ttfts(served.url, model_name, plan, block))
    assert cold.cached_tokens == 0 and 200 <= cold.new_tokens < 400
    assert warm.cached_tokens == cold.new_tokens // block * block
    assert warm.new_tokens >= 2 * block and warm.seconds > 0 and cold.seconds > 0
