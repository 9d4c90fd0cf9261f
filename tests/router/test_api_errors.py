"""Every error status in OpenAI's error shape, and the router keeps serving afterwards."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from tests.router.conftest import wait_until
from tests.router.harness import MAX_BODY_BYTES, MAX_MODEL_LEN

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def post(router, path: str, **kw) -> httpx.Response:
    return httpx.post(router.url + path, timeout=10, **kw)


def assert_error(r: httpx.Response, status: int, *, type_: str, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert (err["type"], err["param"], err["code"]) == (type_, param, code)
    return err


def assert_still_serving(router) -> None:
    router.fake.script.tokens = [2]
    r = post(router, "/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "param"),
    [({"n": 0}, "n"), ({"n": 129}, "n"), ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"),
     ({"stream_options": {"include_usage": True}}, "stream_options"),
     ({"presence_penalty": 9}, "presence_penalty"), ({"stop": [""]}, "stop"),
     ({"top_k": 2**40}, "top_k"), ({"temperature": 1e300}, "temperature")],
)  # fmt: skip
def test_bad_parameters_are_400(router, body, param):
    err = assert_error(
        post(router, "/chat/completions", json={**CHAT, **body}), 400,
        type_="invalid_request_error", param=param,
    )  # fmt: skip
    if param == "n":
        assert "[1, 128]" in err["message"]
    assert router.fake.requests == []
    assert_still_serving(router)


def test_context_length_is_400_with_numbers(router):
    prompt = list(range(10, 10 + MAX_MODEL_LEN - 5))
    r = post(router, "/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 10})
    err = assert_error(r, 400, type_="invalid_request_error", param="max_tokens",
                       code="context_length_exceeded")  # fmt: skip
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    assert (
        f"you requested {MAX_MODEL_LEN + 5} tokens ({MAX_MODEL_LEN - 5} in the prompt, 10 in"
        in err["message"]
    )
    long_prompt = list(range(10, 10 + MAX_MODEL_LEN))
    r = post(router, "/completions", json={"model": MODEL, "prompt": long_prompt})
    assert_error(r, 400, type_="invalid_request_error", param="prompt",
                 code="context_length_exceeded")  # fmt: skip
    r = post(router, "/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert_error(r, 400, type_="invalid_request_error", param="prompt")
    r = post(router, "/completions", json={"model": MODEL, "prompt": [10**9]})
    assert_error(r, 400, type_="invalid_request_error", param="prompt")
    assert_still_serving(router)


def test_unknown_model_is_404_and_model_path_is_accepted(router):
    r = post(router, "/chat/completions", json={**CHAT, "model": "gpt-4o"})
    assert_error(r, 404, type_="invalid_request_error", param="model", code="model_not_found")
    router.fake.script.tokens = [2]
    path = str(router.cfg.model.resolved_path())
    assert post(router, "/chat/completions", json={**CHAT, "model": path}).status_code == 200


def test_schema_errors_are_422(router):
    for body in (
        {"model": MODEL},
        {**CHAT, "messages": "not a list"},
        {**CHAT, "temperature": "hot"},
    ):
        r = post(router, "/chat/completions", json=body)
        assert_error(r, 422, type_="invalid_request_error",
                     param=r.json()["error"]["param"], code="invalid_schema")  # fmt: skip
    r = post(router, "/chat/completions", json={**CHAT, "temperature": "hot"})
    assert r.json()["error"]["param"] == "temperature"
    assert_still_serving(router)


def test_text_that_cannot_be_tokenized_is_400(router):
    body = b'{"messages": [{"role": "user", "content": "lone \\ud800 surrogate"}]}'
    r = post(
        router, "/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    err = assert_error(r, 400, type_="invalid_request_error")
    assert err["message"].startswith("text cannot be tokenized")
    assert_still_serving(router)


def test_malformed_json_is_400(router):
    r = post(router, "/chat/completions", content=b"{not json",
             headers={"content-type": "application/json"})  # fmt: skip
    assert_error(r, 400, type_="invalid_request_error", code="invalid_json")
    assert_still_serving(router)


def test_body_over_limit_is_413_by_length_and_by_stream(router):
    big = b'{"model": "x", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = post(router, "/completions", content=big, headers={"content-type": "application/json"})
    err = assert_error(r, 413, type_="invalid_request_error", code="payload_too_large")
    assert str(MAX_BODY_BYTES) in err["message"]

    def chunks():  # no Content-Length: chunked transfer encoding
        yield big[: MAX_BODY_BYTES // 2]
        yield big[MAX_BODY_BYTES // 2 :]

    r = post(router, "/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, type_="invalid_request_error", code="payload_too_large")
    assert_still_serving(router)


def test_unknown_route_and_method_are_openai_shaped(router):
    assert_error(httpx.get(router.url + "/nope"), 404, type_="not_found_error")
    assert_error(httpx.get(router.url + "/chat/completions"), 405, type_="invalid_request_error")


def test_no_healthy_worker_is_503_with_retry_after(router):
    router.fake.ready = False
    router.wait_health(503)
    r = post(router, "/chat/completions", json=CHAT)
    assert_error(r, 503, type_="service_unavailable")
    assert r.headers["retry-after"] == "1"
    assert router.fake.requests == []
    router.fake.ready = True
    router.wait_health(200)
    assert_still_serving(router)


def test_a_late_health_answer_is_not_an_outage_but_a_silent_worker_is(router):
    # Polls time out after worker_rpc_timeout_s (1 s here); health_missed_polls (3) in a row
    # make the worker unhealthy, fewer do not.
    router.fake.health_delay_s = 1.5
    wait_until(lambda: router.fake.slow_health_calls >= 2, "no second slow Health", timeout=10)
    assert httpx.get(router.url.removesuffix("/v1") + "/health").status_code == 200
    assert_still_serving(router)
    router.wait_health(503)
    router.fake.health_delay_s = 0.0
    router.wait_health(200)
    assert_still_serving(router)


def test_worker_failure_is_502_before_first_token_and_error_event_after(router):
    router.fake.script.fail_code = grpc.StatusCode.INTERNAL
    r = post(router, "/completions", json={"model": MODEL, "prompt": "x"})
    err = assert_error(r, 502, type_="worker_error")
    assert "scripted failure" in err["message"]
    router.fake.script.fail_code = None
    router.fake.script.tokens = router.codec.encode("a b c d", add_special_tokens=False)
    router.fake.script.error_after = 2
    body = {"model": MODEL, "prompt": "x", "stream": True}
    with httpx.stream("POST", router.url + "/completions", json=body, timeout=10) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln]
    assert '"error"' in lines[-2] and "failed the request" in lines[-2]
    assert lines[-1] == "data: [DONE]"
    client = openai.OpenAI(base_url=router.url, api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        list(client.completions.create(model=MODEL, prompt="x", stream=True))
    router.fake.script.error_after = None
    assert_still_serving(router)
