"""The OpenAI API through the official `openai` client, router wired to a fake worker."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.conftest import wait_until
from tests.router.fake_worker import EOS
from tests.router.harness import MAX_MODEL_LEN

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Say hello"}]
TEXT = "Hello there! 😀 世界, naïve 🚀 done."


@pytest.fixture
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url, api_key="unused", max_retries=0, timeout=30)


def script_text(router, text: str, *, eos: bool = True, **kw) -> list[int]:
    ids = router.codec.encode(text, add_special_tokens=False) + ([EOS] if eos else [])
    router.fake.script.tokens = ids
    for k, v in kw.items():
        setattr(router.fake.script, k, v)
    return ids


def test_models_list(client, router):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = httpx.get(router.url + "/models").json()["data"][0]
    assert raw["max_model_len"] == MAX_MODEL_LEN and raw["owned_by"] == "pdd"


def test_models_retrieve(client, router):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.owned_by) == (MODEL, "pdd")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"


def root(router) -> str:
    return router.url.removesuffix("/v1")


def test_tokenize_gives_the_ids_a_request_would_send(client, router):
    """vLLM's /tokenize and /detokenize: a prompt's ids are the ones /v1/completions sends
    the worker, a conversation's the ones /v1/chat/completions sends; detokenize inverts."""
    script_text(router, "ok")
    client.completions.create(model=MODEL, prompt=TEXT)
    sent = list(router.fake.requests[-1].prompt_token_ids)
    r = httpx.post(root(router) + "/tokenize", json={"model": MODEL, "prompt": TEXT}).json()
    assert (r["tokens"], r["count"], r["max_model_len"]) == (sent, len(sent), MAX_MODEL_LEN)
    assert r["token_strs"] is None
    client.chat.completions.create(model=MODEL, messages=MESSAGES)
    sent = list(router.fake.requests[-1].prompt_token_ids)
    r = httpx.post(root(router) + "/tokenize", json={"messages": MESSAGES}).json()
    assert r["tokens"] == sent
    ask = {"messages": MESSAGES, "add_generation_prompt": False, "return_token_strs": True}
    bare = httpx.post(root(router) + "/tokenize", json=ask).json()
    assert sent[: bare["count"]] == bare["tokens"] and bare["count"] < len(sent)
    assert len(bare["token_strs"]) == bare["count"] and bare["token_strs"][0] == "<|im_start|>"
    r = httpx.post(root(router) + "/detokenize", json={"model": MODEL, "tokens": sent})
    assert r.json()["prompt"] == router.codec.decode(sent, skip_special_tokens=False)


def test_an_answer_can_continue_the_assistants_message(client, router):
    """vLLM's continue_final_message: the worker gets the conversation cut where the
    assistant's message ends (no end of turn), as /tokenize shows it too."""
    script_text(router, " red.")
    prefill = [*MESSAGES, {"role": "assistant", "content": "Hello! My favourite colour is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True,
             "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=prefill, extra_body=extra)
    assert r.choices[0].message.content == " red."
    sent = list(router.fake.requests[-1].prompt_token_ids)
    assert router.codec.decode(sent).endswith("assistant\nHello! My favourite colour is")
    shown = httpx.post(root(router) + "/tokenize", json={"messages": prefill, **extra}).json()
    assert shown["tokens"] == sent
    r = httpx.post(router.url + "/chat/completions", json={
        "model": MODEL, "messages": prefill, "continue_final_message": True})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
     ("/tokenize", {}, "prompt"),
     ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, "model"),
     ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template"),
     ("/detokenize", {"tokens": [1, 10**9]}, "tokens")],
)  # fmt: skip
def test_tokenize_refuses_bad_input_naming_the_field(router, path, body, param):
    r = httpx.post(root(router) + path, json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_chat_non_streaming_applies_template_and_counts_usage(client, router):
    ids = script_text(router, TEXT)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    choice = r.choices[0]
    assert choice.message.content == TEXT
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    prompt = router.codec.encode_chat(MESSAGES)
    assert list(router.fake.requests[0].prompt_token_ids) == prompt
    assert router.codec.decode(prompt, skip_special_tokens=False).endswith(
        "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(ids))
    assert r.usage.total_tokens == len(prompt) + len(ids)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    # max_tokens absent: the context left after the prompt.
    assert router.fake.requests[0].sampling.max_tokens == MAX_MODEL_LEN - len(prompt)


def test_chat_streaming_with_usage(client, router):
    ids = script_text(router, TEXT, tokens_per_step=2)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    pieces = [c.choices[0].delta.content or "" for c in body]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert [c.choices[0].finish_reason for c in body][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ids)
    assert last.usage.prompt_tokens == len(router.codec.encode_chat(MESSAGES))


def test_continuous_usage_stats_count_the_tokens_sent_so_far(client, router):
    """vLLM's ``continuous_usage_stats``: every chunk's usage counts the tokens its choices
    have shown so far; the last usage chunk is the request's, as without it."""
    ids = script_text(router, TEXT, tokens_per_step=2)
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, kw in ((client.chat.completions.create, {"messages": MESSAGES}),
                       (client.completions.create, {"prompt": "x"})):  # fmt: skip
        chunks = list(create(model=MODEL, stream=True, stream_options=options, **kw))
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == len(ids)
        assert counts[-2] == len(ids)  # the finishing chunk has counted every token
        assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_stream_without_usage_ends_with_done(router):
    script_text(router, "ok")
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", router.url + "/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: {") for ln in lines[:-1])
    assert '"usage"' not in "".join(lines)


def test_completions_text_tokens_and_single_item_lists(client, router):
    ids = script_text(router, " Paris.")
    for prompt in ("The capital of France is", ["The capital of France is"]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10)
        assert r.choices[0].text == " Paris." and r.choices[0].finish_reason == "stop"
        assert r.object == "text_completion"
        assert r.usage.prompt_tokens == len(router.codec.encode("The capital of France is"))
        assert r.usage.completion_tokens == len(ids)
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=10)
    assert r.usage.prompt_tokens == 3
    assert list(router.fake.requests[-1].prompt_token_ids) == [5, 6, 7]


def test_completions_streaming(client, router):
    script_text(router, TEXT)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="x", stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0


def test_max_tokens_finishes_with_length(client, router):
    script_text(router, "one two three four five six")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert r.choices[0].text == "one two three"
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 3)
    assert router.fake.requests[-1].sampling.max_tokens == 3


def test_sampling_parameters_reach_the_worker(client, router):
    script_text(router, "x")
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.25, top_p=0.5, seed=7, max_tokens=9,
        presence_penalty=0.5, frequency_penalty=-0.5,
        logit_bias={"42": -100, "7": 3}, extra_body={
            "top_k": 5, "repetition_penalty": 1.2, "stop_token_ids": [100], "min_tokens": 1,
            "ignore_eos": True, "min_p": 0.25, "allowed_token_ids": [7, 9, 42],
            "bad_words": ["Eiffel"], "cache_salt": "s1"},
    )  # fmt: skip
    # the body's cache_salt narrows the key's namespace ("" here: authentication is off)
    assert router.fake.requests[-1].cache_salt == '["", "s1"]'
    s = router.fake.requests[-1].sampling
    eiffel = router.codec.encode("Eiffel", add_special_tokens=False)
    assert [list(w.ids) for w in s.bad_words][:1] == [eiffel]
    assert (dict(s.logit_bias), s.min_p, list(s.allowed_token_ids)) == (
        {42: -100.0, 7: 3.0}, 0.25, [7, 9, 42])  # fmt: skip
    assert (s.top_k, s.max_tokens, s.seed, s.min_tokens, s.ignore_eos) == (5, 9, 7, 1, True)
    assert list(s.stop_token_ids) == [100] and s.logprobs == -1
    assert (s.temperature, s.top_p, s.presence_penalty, s.frequency_penalty) == (
        0.25,
        0.5,
        0.5,
        -0.5,
    )
    assert abs(s.repetition_penalty - 1.2) < 1e-6


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_aborts_worker(client, router, stream):
    # 50 ms a token: the worker still streams when the stop string matches, so the router's
    # Abort is due (a worker that already finished its whole script needs none)
    script_text(router, "alpha beta delta beta gamma end", repeat=False, step_delay_s=0.05)
    kwargs = dict(model=MODEL, prompt="x", stop=["beta gamma", "zzz"], max_tokens=50)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        assert all("beta g" not in c.choices[0].text for c in chunks)
    else:
        r = client.completions.create(**kwargs)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert (text, finish) == ("alpha beta delta ", "stop")
    rid = router.fake.requests[-1].request_id
    wait_until(lambda: rid in router.fake.aborts, "router did not send Abort after a stop string")
    r = client.completions.create(**kwargs, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == "alpha beta delta beta gamma"


def test_stop_token_id_ends_without_its_text(client, router):
    ids = script_text(router, "one two three", eos=False)
    r = client.completions.create(model=MODEL, prompt="x", extra_body={"stop_token_ids": [ids[1]]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("one", "stop")
    assert r.usage.completion_tokens == 2


def test_chat_logprobs_shape(client, router):
    ids = script_text(router, "Hi 😀")
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids)
    assert [c.token for c in content[:1]] == ["Hi"]
    assert all(c.logprob == -0.5 and len(c.top_logprobs) == 2 for c in content)
    assert b"".join(bytes(c.bytes) for c in content[:-1]).decode() == "Hi 😀"
    assert content[-1].token == "<|im_end|>"
    assert content[0].top_logprobs[1].logprob == -1.5


def test_completion_logprobs_shape(client, router):
    script_text(router, "ab cd")
    r = client.completions.create(model=MODEL, prompt="x", logprobs=1, max_tokens=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["ab", " cd"]
    assert lp.token_logprobs == [-0.5, -0.5]
    assert lp.text_offset == [0, 2]
    assert lp.top_logprobs == [{"ab": -0.5}, {" cd": -0.5}]
    assert r.choices[0].logprobs is not None
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert r.choices[0].logprobs is None


def test_streamed_chat_logprobs_align_with_text(client, router):
    ids = script_text(router, "A 😀 B")
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, stream=True)
    )
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]  # fmt: skip
    assert len(entries) == len(ids)
    for c in chunks[1:]:
        lps = c.choices[0].logprobs.content if c.choices[0].logprobs else []
        raw = b"".join(bytes(e.bytes) for e in lps if e.token != "<|im_end|>")
        assert raw.decode() == (c.choices[0].delta.content or "")


def test_metrics_and_debug_config(client, router):
    script_text(router, "x y")
    client.completions.create(model=MODEL, prompt="x")
    text = httpx.get(router.root + "/metrics").text
    assert 'pdd_requests_total{finish_reason="stop",pipeline="colocated"}' in text
    assert 'pdd_time_to_first_token_seconds_bucket{le="0.001",pipeline="colocated"}' in text
    assert 'pdd_inter_token_latency_seconds_bucket{le="0.01",pipeline="colocated"}' in text
    assert 'pdd_e2e_request_latency_seconds_bucket{le="7680.0",pipeline="colocated"}' in text
    assert 'pdd_generation_tokens_total{pipeline="colocated"}' in text
    assert 'pdd_worker_healthy{role="colocated",worker="w0"} 1.0' in text
    assert "cmpl-" not in text
    cfg = httpx.get(router.root + "/debug/config").json()
    assert cfg == router.cfg.model_dump(mode="json")


def test_pdd_status_shows_the_fleet(router, capsys):
    from pdd.router import status

    assert status.main(["--url", router.url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "mode=colocated in_flight=0"
    assert out[1].split()[:3] == ["w0", "colocated", router.fake_target]
    assert out[1].endswith("healthy")


def test_a_restarted_worker_is_counted_in_status_and_metrics(router, capsys):
    """A worker that comes back as a new process (crash, OOM kill, redeploy) shows in
    /debug/workers, `pdd status` and pdd_worker_restarts_total."""
    from pdd.router import status

    def restarts() -> int:
        return httpx.get(router.root + "/debug/workers").json()["workers"][0]["restarts"]

    before = restarts()
    router.fake.instance_id = f"process-{before + 2}"
    wait_until(lambda: restarts() == before + 1, "the router never saw the restart")
    metric = 'pdd_worker_restarts_total{role="colocated",worker="w0"}'
    wait_until(lambda: f"{metric} {before + 1}.0" in httpx.get(router.root + "/metrics").text,
               "pdd_worker_restarts_total did not count the restart")  # fmt: skip
    assert status.main(["--url", router.url]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert f"restarts={before + 1}" in line.split() and line.endswith("healthy")


def test_colocated_record_and_header(router):
    ids = script_text(router, "ok")
    body = {"model": MODEL, "prompt": "x"}
    r = httpx.post(router.url + "/completions", json=body)
    assert r.headers["x-pdd-pipeline"] == "colocated"
    assert r.json()["pdd"] == {
        "pipeline": "colocated", "prompt_tokens": 1, "md_cached_tokens": 0, "wan_kv_bytes": 0,
        "wan_kv_raw_bytes": 0,
        "rld_tokens": 0, "handoff": "none", "handoff_rounds": 0, "md_computed": False, "p": None,
        "rld": None,
        "md": None,
    }  # fmt: skip
    with httpx.stream("POST", router.url + "/completions", json={**body, "stream": True}) as s:
        assert s.headers["x-pdd-pipeline"] == "colocated"
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert '"pdd":{"pipeline":"colocated"' in chunks[-1]
    assert all('"pdd"' not in c for c in chunks[:-1])
    assert len(ids) == 2


@pytest.mark.parametrize("pipeline", ["p_md", "p_rld_md"])
def test_colocated_refuses_pdd_pipeline_overrides(router, pipeline):
    body = {"model": MODEL, "prompt": "x", "pdd": {"pipeline": pipeline}}
    r = httpx.post(router.url + "/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "pdd"
    body["pdd"] = {"pipeline": "auto", "handoff": "auto"}
    script_text(router, "ok")
    assert httpx.post(router.url + "/completions", json=body).status_code == 200


def test_completion_echo_and_prompt_logprobs_shapes(client, router):
    """vLLM's shapes: ``echo`` puts the prompt (text, then logprob entries, the first None)
    before the completion; ``prompt_logprobs`` is a list with one entry per prompt token,
    None first; ``echo`` with ``max_tokens`` 0 shows the prompt alone."""
    script_text(router, "ab cd")
    prompt = "Say hi"
    ids = router.codec.encode(prompt)
    n = len(ids)
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=2)
    assert r.choices[0].text == prompt + "ab cd"
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [None] + [-1.0] * (n - 1) + [-0.5, -0.5]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[1] == {
        router.codec.token_text(ids[1]): -1.0, router.codec.token_text(ids[1] + 1): -0.5,
    }  # fmt: skip
    assert lp.tokens[n:] == ["ab", " cd"] and lp.text_offset[n:] == [len(prompt), len(prompt) + 2]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    positions = r.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == n and positions[0] is None
    assert positions[1] == {
        str(ids[1]): {"logprob": -1.0, "rank": 2, "decoded_token": router.codec.token_text(ids[1])},
        str(ids[1] + 1): {
            "logprob": -0.5, "rank": 1, "decoded_token": router.codec.token_text(ids[1] + 1)
        },
    }  # fmt: skip
    assert r.choices[0].text == "ab cd" and r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0)
    assert (r.choices[0].text, r.usage.completion_tokens) == (prompt, 1)
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, echo=True, stream=True, max_tokens=2)
    )
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + "ab cd"
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    chat_positions = r.model_extra["prompt_logprobs"]
    assert chat_positions[0] is None and all(len(p) == 1 for p in chat_positions[1:])


def test_several_choices_are_sampled_as_vllm_does(client, router):
    """n=3: three choices, each a request of its own (seed + i, as vLLM's parallel
    sampling), the prompt counted once in the usage and each choice's own pdd record; a
    stream interleaves them by index, the role chunk first for each."""
    ids = script_text(router, "ab cd")
    r = client.completions.create(model=MODEL, prompt="x", n=3, seed=7, temperature=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.text == "ab cd" for c in r.choices)
    assert [q.sampling.seed for q in router.fake.requests] == [7, 8, 9]
    assert len({q.request_id for q in router.fake.requests}) == 3
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (1, 3 * len(ids))
    assert all(c.model_extra["pdd"]["pipeline"] == "colocated" for c in r.choices)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    body = [c for c in chunks if c.choices]
    assert [c.choices[0].delta.role for c in body[:2]] == ["assistant", "assistant"]
    assert [c.choices[0].index for c in body[:2]] == [0, 1]
    for i in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == "ab cd"
        assert [c.finish_reason for c in mine][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(ids)
