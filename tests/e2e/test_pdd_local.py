"""The PDD core end to end on one host: `pdd serve --config configs/local.yaml` (router + P +
RLD + MD, real vLLM, float32), plus routers in the baseline modes over the same workers.

The oracle: with greedy decoding, every pipeline's tokens equal a direct single-engine vLLM
run of the same token-ID prompt. Every test ends with zero pinned slots and zero open
transfers on every worker.
"""

from __future__ import annotations

import contextlib
import json

import grpc
import httpx
import psutil
import pytest

from pdd.config import ModelConfig, load_config
from pdd.proto import worker_pb2, worker_pb2_grpc
from pdd.router.text.tokenizer import TextCodec
from tests.helpers import at_once, run_oracle, serve, start_router, stop, wait_until
from tests.observability import live, scrape
from tests.router.test_api_tools import TIME, WEATHER  # the tools the fake-worker tests use

pytestmark = pytest.mark.slow

CONFIG = "configs/local.yaml"
WORKERS = ["p", "rld", "md"]
DTYPE = "float32"
MAX_TOKENS = 16
# P prefills 64 tokens a step, so its KV streams in parts while it prefills (router.pdd.stream_kv):
# every equality below holds through parts that end inside RLD's and MD's blocks too.
COMMON = [f"model.dtype={DTYPE}", "workers.0.engine.max_num_batched_tokens=64"]

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Why is the sky blue? Answer in one sentence.",
    "Translate 'good morning' into Spanish.",
    "List two planets of the solar system.",
]
RAW = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of motion are",
]
SENTENCES = [
    "The river winds through the valley and feeds the old mill by the bridge.",
    "Engineers measured the load on every beam before the winter storms arrived.",
    "In the market, traders argued about the price of silver and spices.",
    "A quiet library keeps its oldest maps in a cold room under the stairs.",
]


def _long_text(n_sentences: int, shift: int) -> str:
    return " ".join(SENTENCES[(i + shift) % len(SENTENCES)] for i in range(n_sentences))


def build_prompts(codec: TextCodec) -> list[list[int]]:
    """20+ token-ID prompts: chat questions, raw text, long documents, multi-turn chats."""
    prompts = [codec.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts += [codec.encode(t) for t in RAW]
    for n, shift in ((12, 0), (30, 1), (50, 2), (70, 3)):  # ~200 to ~1,200 tokens
        prompts.append(codec.encode(_long_text(n, shift) + "\nSummary:"))
    for i in range(4):
        history = [
            {"role": "user", "content": _long_text(6 + 4 * i, i) + " What is this about?"},
            {"role": "assistant", "content": "It describes a few scenes from daily life."},
            {"role": "user", "content": QUESTIONS[i]},
        ]
        prompts.append(codec.encode_chat(history))
    return prompts


@pytest.fixture(scope="module")
def codec():
    return TextCodec.from_folder(ModelConfig(dtype=DTYPE).resolved_path())


@pytest.fixture(scope="module")
def prompts(codec):
    return build_prompts(codec)


@pytest.fixture(scope="module")
def oracles(codec, prompts):
    """One engine, greedy, in one oracle run (one vLLM start): the tokens of ``prompts``;
    vLLM's own structured outputs (xgrammar) of SCHEMAS; the SAMPLED questions under their
    sampling settings."""
    chat = lambda q: codec.encode_chat([{"role": "user", "content": q}])  # noqa: E731
    long = {"max_tokens": SCHEMA_MAX_TOKENS}
    runs = [{"prompt_token_ids": p} for p in prompts]
    runs += [{"prompt_token_ids": chat(q), "json_schema": schema, **long} for q, schema in SCHEMAS]
    runs += [{"prompt_token_ids": chat(q), "sampling": s, **long} for q, s in sampled(codec)]
    logprobs = {"prompt_logprobs": 1, "logprobs": 1}
    runs += [{"prompt_token_ids": p, "sampling": logprobs} for p in echoed(prompts)]
    out = run_oracle(runs, DTYPE, MAX_TOKENS)
    n, k = len(prompts), len(prompts) + len(SCHEMAS)
    e = k + len(sampled(codec))
    return {"plain": out[:n], "schema": out[n:k], "sampled": out[k:e], "echo": out[e:]}


def echoed(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts of the echo test: a chat question and a ~200-token document."""
    return [prompts[0], prompts[len(QUESTIONS) + len(RAW)]]


@pytest.fixture(scope="module")
def oracle(oracles):
    return oracles["plain"]


@pytest.fixture(scope="module")
def served():
    s = serve(CONFIG, WORKERS, COMMON, pin_metrics_ports=True)
    yield s
    assert stop(s) == 0, s.log_tail()


def _router_overrides(served, mode: str) -> list[str]:
    ports = [f"workers.{i}.port={served.worker_ports[w]}" for i, w in enumerate(WORKERS)]
    return [*COMMON, *ports, f"router.mode={mode}"]


@pytest.fixture(scope="module")
def baselines(served):
    routers = {
        m: start_router(CONFIG, _router_overrides(served, m)) for m in ("pd_wan", "pd_local")
    }
    yield {m: r.url for m, r in routers.items()}
    for r in routers.values():
        stop(r)


def stats(served, worker: str) -> worker_pb2.StatsResponse:
    with grpc.insecure_channel(f"127.0.0.1:{served.worker_ports[worker]}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


@pytest.fixture(autouse=True)
def no_leaks(served):
    yield
    for w in WORKERS:
        wait_until(
            lambda w=w: (s := stats(served, w)).pinned_slots == 0 and s.open_transfers == 0,
            30,
            f"{w}: zero pinned slots and zero open transfers",
        )
        assert stats(served, w).running_requests == 0


def complete(url: str, prompt: list[int], pdd: dict | None = None, **kw) -> dict:
    body = {"model": load_config(CONFIG).model.name, "prompt": prompt, "temperature": 0}
    body |= {"max_tokens": MAX_TOKENS, **kw}
    if pdd:
        body["pdd"] = pdd
    r = httpx.post(f"{url}/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.headers["x-pdd-pipeline"] == r.json()["pdd"]["pipeline"]
    return r.json()


VARIANTS = {
    "p_md": {"pipeline": "p_md"},
    "p_rld_md_one_shot": {"pipeline": "p_rld_md", "handoff": "one_shot"},
    "p_rld_md_catch_up": {"pipeline": "p_rld_md", "handoff": "catch_up"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pdd_pipelines_equal_single_engine(served, codec, prompts, oracle, variant):
    assert len(prompts) >= 20
    bodies = at_once(lambda p: complete(served.url, p, VARIANTS[variant]), prompts)
    for prompt, expected, body in zip(prompts, oracle, bodies, strict=True):
        got = body["choices"][0]["text"]
        want = codec.decode(expected["token_ids"])
        assert got == want, (variant, len(prompt), body["pdd"])
        assert body["usage"]["completion_tokens"] == len(expected["token_ids"])
        assert body["pdd"]["pipeline"] == VARIANTS[variant]["pipeline"]
        assert body["pdd"]["prompt_tokens"] == len(prompt)


@pytest.mark.parametrize("mode", ["pd_wan", "pd_local"])
def test_baselines_equal_single_engine(baselines, codec, prompts, oracle, mode):
    bodies = at_once(lambda p: complete(baselines[mode], p), prompts)
    for expected, body in zip(oracle, bodies, strict=True):
        assert body["choices"][0]["text"] == codec.decode(expected["token_ids"]), mode
        assert body["pdd"]["pipeline"] == "pd"
        assert body["pdd"]["rld_tokens"] == 0
    if mode == "pd_wan":  # D's own DRC, as vLLM's decoder: a prompt it holds sends no KV
        block = load_config(CONFIG).engine.block_size
        body = complete(baselines[mode], prompts[0])
        assert body["choices"][0]["text"] == codec.decode(oracle[0]["token_ids"])
        assert body["pdd"]["md_cached_tokens"] == len(prompts[0]) // block * block
        assert body["pdd"]["wan_kv_bytes"] == 0


def test_every_dashboard_metric_exists_and_moves(served):
    """The dashboard's metrics on this running system (tests/observability/live.py): each is
    exported by every process the catalog names and moves under traffic down each pipeline,
    through a router whose SLA every request meets (so goodput counts)."""
    router = start_router(CONFIG, [*_router_overrides(served, "pdd"), *live.SLA])
    try:
        murls = {w: f"http://127.0.0.1:{p}/metrics" for w, p in served.metrics_ports.items()}
        role_of = {w.id: w.role.value for w in load_config(CONFIG).workers}
        missing, still = live.dashboard_gaps(router.url, murls, role_of)
    finally:
        stop(router)
    assert missing == {}, f"dashboard metrics not exported: {missing}"
    assert still == [], f"metrics that did not move under traffic: {still}"


def test_second_turn_sends_only_new_blocks(served, codec):
    """DRC: turn 2 of a conversation finds turn 1's prompt on MD; only new blocks cross."""
    block = load_config(CONFIG).engine.block_size
    bytes_per_block = stats(served, "md").kv_block_bytes
    turn1 = [{"role": "user", "content": _long_text(40, 1) + " Summarize this."}]
    body1 = complete_chat(served.url, turn1, {"pipeline": "p_rld_md"})
    p1 = body1["usage"]["prompt_tokens"]
    turn2 = turn1 + [
        {"role": "assistant", "content": body1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Now say it in five words."},
    ]
    wait_until(lambda: stats(served, "md").pinned_slots == 0, 30, "MD stored turn 1's blocks")
    stored_before = stats(served, "md").own_blocks_stored
    body2 = complete_chat(served.url, turn2, None)
    pd2 = body2["pdd"]
    assert pd2["md_cached_tokens"] >= (p1 // block) * block
    new_blocks = pd2["prompt_tokens"] // block - pd2["md_cached_tokens"] // block
    assert pd2["wan_kv_bytes"] == new_blocks * bytes_per_block
    assert pd2["wan_kv_bytes"] < (p1 // block) * bytes_per_block
    # After turn 2, MD stores (its engine copies) only the blocks of its own output the DRC
    # lacks; every block of turn 2's prompt is already there.
    tokens = pd2["prompt_tokens"] + body2["usage"]["completion_tokens"]
    own = (tokens - 1) // block - pd2["prompt_tokens"] // block
    stored = lambda: stats(served, "md").own_blocks_stored - stored_before  # noqa: E731
    wait_until(lambda: stored() == own and stats(served, "md").pinned_slots == 0, 30,
               f"MD stores {own} blocks of its own")  # fmt: skip


def _prompt_counters(served, worker: str) -> dict[str, float]:
    """A worker's prompt tokens received by RPC and prompt references by outcome (/metrics)."""
    url = f"http://127.0.0.1:{served.metrics_ports[worker]}/metrics"
    families = scrape.parse(httpx.get(url, timeout=10).text)
    tokens, refs = "pdd_worker_prompt_tokens_received_total", "pdd_worker_prompt_refs_total"
    return {
        **{rpc: scrape.value(families, tokens, rpc=rpc) for rpc in ("Generate", "PrepareKv")},
        **{o: scrape.value(families, refs, outcome=o) for o in ("resolved", "missing")},
    }


@pytest.mark.parametrize("variant", ["p_md", "p_rld_md_catch_up"])
def test_the_prompt_crosses_the_wan_to_md_once(served, codec, variant):
    """MD gets a request's prompt once, in PrepareKv; its Generates (the warm-ups and the
    switch too) carry only the tokens emitted since, and the answer is unchanged. With
    Catch-Up they are one request on MD: every call after the first warm-up continued the
    session it opened (MD computed only the tokens emitted since)."""
    prompt = codec.encode(f"Variant {variant}:\n" + _long_text(30, 5))  # nothing cached
    before = {w: _prompt_counters(served, w) for w in ("rld", "md")}
    turns = stats(served, "md").md_session_turns
    body = complete(served.url, prompt, VARIANTS[variant])
    after = {w: _prompt_counters(served, w) for w in ("rld", "md")}
    if body["pdd"]["handoff"] == "catch_up":
        continued = stats(served, "md").md_session_turns - turns
        assert continued == body["pdd"]["handoff_rounds"] - 1 >= 1
    delta = {w: {k: v - before[w].get(k, 0.0) for k, v in after[w].items()} for w in after}
    md = delta["md"]
    assert md["PrepareKv"] == len(prompt)
    calls = max(1, body["pdd"]["handoff_rounds"])  # MD's Generates: the warm-ups and the switch
    assert 0 < md["Generate"] <= calls * body["usage"]["completion_tokens"] < len(prompt)
    assert md["resolved"] >= 1 and md.get("missing", 0.0) == 0
    if body["pdd"]["pipeline"] == "p_rld_md":
        # RLD's Generate (if MD's KV was not there first) carries P's token alone
        assert delta["rld"]["PrepareKv"] == len(prompt) and delta["rld"].get("Generate", 0) <= 1


def _timeline(served, request_id: str) -> list[dict]:
    url = served.url.removesuffix("/v1") + f"/debug/requests/{request_id}"
    return httpx.get(url, timeout=10).json()["timeline"]


@pytest.mark.parametrize("aligned", [False, True], ids=["tail", "whole_blocks"])
def test_full_hit_sends_no_kv_and_never_waits(served, codec, aligned):
    """A repeated prompt whose every whole block MD holds (its DRC stored them after the
    first run): no KV crosses, nobody waits for a transfer, and the answer is the same.
    ``whole_blocks``: the prompt is an exact multiple of the block size (every prompt token's
    KV is on MD; vLLM still computes the last one, plus P's token)."""
    block = load_config(CONFIG).engine.block_size
    prompt = codec.encode(_long_text(9, 2) + "\nIn short:")
    if aligned:
        prompt = prompt[: len(prompt) // block * block]
    first = complete(served.url, prompt, {"pipeline": "p_md"})
    wait_until(lambda: stats(served, "p").open_transfers == 0, 30, "P's sends acknowledged")
    before = {w: stats(served, w) for w in ("p", "md")}
    again = complete(served.url, prompt, {"pipeline": "p_md"})
    after = {w: stats(served, w) for w in ("p", "md")}
    pd = again["pdd"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert pd["md_cached_tokens"] == len(prompt) // block * block
    assert (pd["wan_kv_bytes"], pd["wan_kv_raw_bytes"]) == (0, 0)
    assert after["md"].kv_bytes_received == before["md"].kv_bytes_received
    assert after["p"].kv_bytes_sent == before["p"].kv_bytes_sent
    assert after["md"].kv_in_waits == before["md"].kv_in_waits  # MD's Generate never waited
    events = {(e["event"], e["worker"]) for e in _timeline(served, again["id"])}
    assert ("send_kv", "p") not in events and ("await_kv", "md") not in events
    assert ("generate", "md") in events


def test_a_prompt_at_max_model_len_is_served_and_one_longer_is_a_400(served, codec):
    """Every arena holds a request at max_model_len (the workers checked it at start:
    pdd.worker.capacity), so the longest prompt the context allows is served on both
    pipelines; one token more is refused with a 400 naming the limit, never a 429."""
    limit = load_config(CONFIG).engine.max_model_len
    text = _long_text(400, 3)
    prompt = codec.encode(text)[: limit - 2]
    assert len(prompt) == limit - 2
    for pipeline in ("p_md", "p_rld_md"):
        body = complete(served.url, prompt, {"pipeline": pipeline}, max_tokens=2)
        assert body["usage"]["completion_tokens"] == 2 and body["pdd"]["pipeline"] == pipeline
    too_long = codec.encode(text)[: limit - 1]
    body = {"model": load_config(CONFIG).model.name, "prompt": too_long, "max_tokens": 2}
    r = httpx.post(f"{served.url}/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert f"maximum context length is {limit} tokens" in r.json()["error"]["message"]


def complete_chat(url: str, messages: list[dict], pdd: dict | None) -> dict:
    body = {"model": load_config(CONFIG).model.name, "messages": messages, "temperature": 0}
    body["max_tokens"] = 24
    if pdd:
        body["pdd"] = pdd
    r = httpx.post(f"{url}/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_stream_is_rld_tokens_then_md_tokens(served, codec, prompts, oracle):
    """The streamed text of a p_rld_md request is exactly the oracle's, with no repeats or
    gaps, and the record attributes each token to a tier."""
    prompt, expected = prompts[-5], oracle[-5]
    body = {
        "model": load_config(CONFIG).model.name,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "pdd": {"pipeline": "p_rld_md", "handoff": "one_shot"},
    }
    text, record = [], None
    with httpx.stream("POST", f"{served.url}/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                text.append(c.get("text") or "")
            record = chunk.get("pdd") or record
    assert "".join(text) == codec.decode(expected["token_ids"])
    assert record["pipeline"] == "p_rld_md" and record["handoff"] in ("one_shot", "rld_finished")
    assert 0 <= record["rld_tokens"] <= len(expected["token_ids"])


def _worker_process(served, worker: str) -> psutil.Process:
    """The `pdd worker` process of ``worker`` under `pdd serve`."""
    for child in psutil.Process(served.proc.pid).children():
        argv = child.cmdline()
        if "--worker" in argv and argv[argv.index("--worker") + 1] == worker:
            return child
    raise AssertionError(f"no process of worker {worker}")


def _healthy(served) -> bool:
    r = httpx.get(served.url.removesuffix("/v1") + "/health", timeout=5)
    return r.status_code == 200 and all(w["healthy"] for w in r.json()["workers"])


def _health(served, worker: str) -> worker_pb2.HealthResponse:
    with grpc.insecure_channel(f"127.0.0.1:{served.worker_ports[worker]}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=10)


def test_health_and_status_show_each_workers_kv_geometry(served):
    from pdd.kv_geometry import KvGeometry, folder_geometry
    from pdd.router.status import format_status

    folder = ModelConfig(dtype=DTYPE).resolved_path()
    want = folder_geometry(folder, block_size=32, kv_dtype=DTYPE)  # what vLLM must agree with
    for w in WORKERS:
        assert KvGeometry.from_proto(_health(served, w).geometry) == want, w
    # real chunks pass the receivers' geometry check: MD lands P's KV, nobody refuses any
    # (RLD may give up waiting on a loaded machine and recompute: not asserted). The One-Shot
    # switch comes right after RLD's Generate began: the cancel that once left RLD's fence
    # unposted (docs/notes/engine.md); every later test's leak check would see it
    before = stats(served, "md").kv_bytes_received
    prompt = [{"role": "user", "content": "KV geometry probe. " + _long_text(12, 2)}]
    complete_chat(served.url, prompt, {"pipeline": "p_rld_md", "handoff": "one_shot"})
    assert stats(served, "md").kv_bytes_received > before
    assert [stats(served, w).kv_refused_chunks for w in ("rld", "md")] == [0, 0]
    data = httpx.get(served.url.removesuffix("/v1") + "/debug/workers", timeout=5).json()
    assert all(row["geometry"] == want.model_dump() and row["admitted"] for row in data["workers"])
    lines = format_status(data)
    assert all(f"kv_geometry={want.fingerprint[:12]}/L30/kvh0-3of3/d64/B32/float32" in ln
               for ln in lines[1:])  # fmt: skip


def _other_model(tmp_path):
    """A copy of the model (symlinks) whose config differs: another model to the fingerprint."""
    src = ModelConfig(dtype=DTYPE).resolved_path()
    other = tmp_path / "other-model"
    other.mkdir()
    for f in src.iterdir():
        if f.name not in ("config.json", "pdd-model.json"):
            (other / f.name).symlink_to(f)
    hf = json.loads((src / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**hf, "rms_norm_eps": 1e-6}))
    return other


def test_workers_of_another_model_than_the_routers_are_not_admitted(served, tmp_path):
    """A router serving another model folder admits none of these workers: each shows NOT
    ADMITTED naming it and the field, and nothing is routed."""
    from pdd.router.status import format_status

    other = _other_model(tmp_path)
    router = start_router(CONFIG, [*_router_overrides(served, "pdd"), f"model.path={other}"])
    root = router.url.removesuffix("/v1")
    try:

        def refused():
            rows = httpx.get(root + "/debug/workers", timeout=5).json()["workers"]
            return all(not r["admitted"] for r in rows) and rows

        rows = wait_until(refused, 30, "every worker refused")
        for r in rows:
            assert r["healthy"] is False
            assert r["last_error"].startswith(
                f"not admitted: workers {r['id']} and router model {other} cannot exchange KV: "
                "fingerprint differs"
            ), r
        lines = format_status(httpx.get(root + "/debug/workers", timeout=5).json())
        assert all("NOT ADMITTED" in ln for ln in lines[1:])
        body = {"model": load_config(CONFIG).model.name, "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(router.url + "/completions", json=body, timeout=30).status_code == 503
    finally:
        stop(router)


@contextlib.contextmanager
def _extra_worker(worker: str, engine: list[str], log_path, sets: tuple[str, ...] = ()):
    """One more engine process for ``worker``'s entry of CONFIG, on free ports, with its
    ``engine`` settings (KEY=VALUE) and any other ``sets`` changed; yields its gRPC port."""
    import subprocess
    import sys

    from pdd.launch import free_port

    i, port = WORKERS.index(worker), free_port()
    sets = [f"workers.{i}.port={port}", f"workers.{i}.metrics_port={free_port()}",
            f"workers.{i}.kv_port={free_port()}", f"workers.{i}.engine.kv_cache_space_gib=0.25",
            *[f"workers.{i}.engine.{e}" for e in engine], *sets, *COMMON]  # fmt: skip
    args = [sys.executable, "-m", "pdd.launch.worker", "--config", CONFIG, "--worker", worker,
            *[a for s in sets for a in ("--set", s)]]  # fmt: skip
    with log_path.open("w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()  # "pdd worker ready: ..." (or EOF if it died)
        assert line.startswith("pdd worker ready"), log_path.read_text()[-3000:]
        yield port
        wait_until(lambda: (m := _stats_at(port)).pinned_slots == 0 and m.open_transfers == 0,
                   30, f"the extra {worker}: zero pinned slots and open transfers")  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(90)


@contextlib.contextmanager
def _router_over(served, replaced: dict[str, int], sets: tuple[str, ...] = (), headers=None):
    """A pdd router over the suite's workers, some of them replaced (worker -> gRPC port);
    yields it once every worker is healthy, with the rows of /debug/workers."""
    ports = [f"workers.{WORKERS.index(w)}.port={port}" for w, port in replaced.items()]
    router = start_router(CONFIG, [*_router_overrides(served, "pdd"), *ports, *sets])
    root = router.url.removesuffix("/v1")

    def all_healthy():
        rows = httpx.get(root + "/debug/workers", timeout=5, headers=headers).json()["workers"]
        return all(r["healthy"] for r in rows) and {r["id"]: r for r in rows}

    try:
        yield router, wait_until(all_healthy, 60, "every worker healthy")
    finally:
        stop(router)


def _stats_at(port: int) -> worker_pb2.StatsResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


def test_an_md_of_another_kv_dtype_lands_ps_kv_converted_or_is_refused(served, tmp_path):
    """A fourth engine: MD with workers[].engine.dtype bfloat16 (same model: admitted, the
    fingerprint ignores the dtype) behind a router with this float32 P and RLD. Where vLLM runs
    bfloat16 with its vec kernels, MD converts P's float32 KV as it lands: a two-turn
    conversation (p_rld_md, then p_md) is served with MD loading P's KV, no chunk refused, and
    turn 2 finds turn 1's prompt in MD's DRC, so only the new blocks (P's bytes) cross. Where it
    runs bfloat16 on AMX (this machine), the block interior differs and is not converted: every
    request is refused naming both workers and the field, never served from corrupt KV."""
    with (_extra_worker("md", ["dtype=bfloat16"], tmp_path / "md-bf16.log") as port,
          _router_over(served, {"md": port}) as (router, rows)):  # fmt: skip
        geometry = rows["md"]["geometry"]
        assert geometry["kv_dtype"] == "bfloat16" and rows["md"]["admitted"]
        assert geometry["fingerprint"] == rows["p"]["geometry"]["fingerprint"]
        if geometry["layout"] != "cpu_amx":
            _two_turns(served, router, port, "Notes on bfloat16. " + _long_text(30, 2))
            return
        _assert_layouts_refused(router, "cpu_packed_kv", "cpu_amx")


def _assert_layouts_refused(router, p_layout: str, md_layout: str) -> None:
    """A request is refused (503) naming both workers and their layouts."""
    body = {"model": load_config(CONFIG).model.name, "prompt": "Hello", "max_tokens": 2}
    r = httpx.post(router.url + "/completions", json=body, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == (
        "no main_decode worker can take KV from p: workers p and md cannot exchange KV: "
        f"layout differs (p: {p_layout}, md: {md_layout})"
    )


def test_a_p_of_another_kv_dtype_sends_kv_its_receivers_widen(served, tmp_path):
    """The reverse: a bfloat16 P (workers[].engine.dtype) with the suite's float32 RLD and MD.
    Where vLLM runs bfloat16 with its vec kernels, RLD and MD widen P's KV as it lands
    (bit-exact): a two-turn conversation is served with MD loading it, no chunk refused, turn 2
    finds turn 1's prompt in MD's DRC, and the WAN carries P's bfloat16 bytes (half of
    float32's) of the new blocks only. Where it runs bfloat16 on AMX, P's block interior is
    not converted: every request is refused naming both workers and the field."""
    with (_extra_worker("p", ["dtype=bfloat16"], tmp_path / "p-bf16.log") as port,
          _router_over(served, {"p": port}) as (router, rows)):  # fmt: skip
        geometry = rows["p"]["geometry"]
        assert geometry["kv_dtype"] == "bfloat16" and rows["p"]["admitted"]
        assert _stats_at(port).kv_block_bytes * 2 == stats(served, "md").kv_block_bytes
        if geometry["layout"] == "cpu_amx":
            _assert_layouts_refused(router, "cpu_amx", "cpu_packed_kv")
            return
        refused = stats(served, "rld").kv_refused_chunks
        _two_turns(served, router, served.worker_ports["md"],
                   "Notes on widening. " + _long_text(30, 3), port)  # fmt: skip
        assert stats(served, "rld").kv_refused_chunks == refused


def _two_turns(served, router, md_port: int, text: str, p_port: int | None = None) -> None:
    """Turn 1 (p_rld_md) carries P's whole blocks to MD; turn 2 (p_md) finds them in MD's
    DRC (at least turn 1's prompt in MD's blocks) and only P's blocks past them cross.
    ``p_port``: the router's P, when it is not the suite's."""
    p = _stats_at(p_port) if p_port else stats(served, "p")
    p_block, p_block_bytes = p.block_size, p.kv_block_bytes
    before = _stats_at(md_port)
    md_block = before.block_size
    turn1 = [{"role": "user", "content": text + " Summarize this."}]  # new to MD: all of it
    body1 = complete_chat(router.url, turn1, {"pipeline": "p_rld_md"})
    pd1, p1 = body1["pdd"], body1["usage"]["prompt_tokens"]
    assert (pd1["pipeline"], pd1["md"], pd1["rld"]) == ("p_rld_md", "md", "rld"), pd1
    assert pd1["wan_kv_bytes"] == (p1 // p_block) * p_block_bytes  # P's blocks, P's bytes
    assert body1["choices"][0]["message"]["content"]
    turn2 = turn1 + [
        {"role": "assistant", "content": body1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Now say it in five words."},
    ]
    body2 = complete_chat(router.url, turn2, {"pipeline": "p_md"})
    pd2 = body2["pdd"]
    assert pd2["md_cached_tokens"] >= (p1 // md_block) * md_block, pd2
    new_blocks = pd2["prompt_tokens"] // p_block - pd2["md_cached_tokens"] // p_block
    assert pd2["wan_kv_bytes"] == new_blocks * p_block_bytes
    assert body2["choices"][0]["message"]["content"]
    s = _stats_at(md_port)
    assert s.kv_refused_chunks == before.kv_refused_chunks
    assert s.kv_bytes_received > before.kv_bytes_received


@pytest.fixture(scope="module")
def md_block_128(served, tmp_path_factory):
    """The suite's P and RLD (block 32) with an MD of block 128 (float32): MD regroups P's
    blocks into its own as they land."""
    log = tmp_path_factory.mktemp("md128") / "md.log"
    with (_extra_worker("md", ["block_size=128"], log) as port,
          _router_over(served, {"md": port}) as (router, rows)):  # fmt: skip
        assert (
            rows["md"]["geometry"]["block_size"] == 128
            and rows["p"]["geometry"]["block_size"] == 32
        )
        yield router, port


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_md_of_another_block_size_equals_single_engine(md_block_128, codec, prompts, oracle,
                                                          variant):  # fmt: skip
    """P block 32 -> MD block 128, float32: every pipeline's greedy text equals one engine's."""
    router, port = md_block_128
    bodies = at_once(lambda p: complete(router.url, p, VARIANTS[variant]), prompts)
    for prompt, expected, body in zip(prompts, oracle, bodies, strict=True):
        assert body["choices"][0]["text"] == codec.decode(expected["token_ids"]), (
            variant, len(prompt), body["pdd"])  # fmt: skip
        assert body["pdd"]["pipeline"] == VARIANTS[variant]["pipeline"]
    assert _stats_at(port).kv_refused_chunks == 0


def test_an_md_of_another_block_size_keeps_the_conversation(served, md_block_128):
    router, port = md_block_128
    _two_turns(served, router, port, "Notes on blocks. " + _long_text(34, 3))


def test_a_p_of_another_block_size_equals_single_engine(served, codec, prompts, oracle, tmp_path):
    """P block 128 -> RLD and MD block 32, float32: the greedy text of p_md and of p_rld_md
    with One-Shot and with Catch-Up equals one engine's. RLD and MD each regroup P's blocks
    into their own as they land; neither refuses a chunk. p_md runs every prompt, each
    p_rld_md variant every 4th (all 20 took 6 minutes: run once, 2026-12-04, all equal)."""
    refused = {w: stats(served, w).kv_refused_chunks for w in ("rld", "md")}
    with (_extra_worker("p", ["block_size=128"], tmp_path / "p128.log") as port,
          _router_over(served, {"p": port}) as (router, rows)):  # fmt: skip
        assert rows["p"]["geometry"]["block_size"] == 128
        for variant, hints in VARIANTS.items():
            step = 1 if variant == "p_md" else 4
            some = prompts[::step]
            bodies = at_once(lambda p, hints=hints: complete(router.url, p, hints), some)
            for prompt, expected, body in zip(some, oracle[::step], bodies, strict=True):
                assert body["choices"][0]["text"] == codec.decode(expected["token_ids"]), (
                    variant, len(prompt), body["pdd"])  # fmt: skip
                assert body["pdd"]["pipeline"] == hints["pipeline"]
    assert {w: stats(served, w).kv_refused_chunks for w in ("rld", "md")} == refused


# The default model's 3 KV heads (9 attention heads) take TP 3, not 2; its ranks on both cores.
TP3 = {"tensor_parallel_size": 3, "omp_threads_bind": "0|1|1"}


def test_an_md_at_tensor_parallel_3_equals_its_own_configuration(served, codec, prompts,
                                                                 tmp_path):  # fmt: skip
    """P at TP 1 -> MD at TP 3 (float32; vLLM refuses TP 2 on this model): each of MD's three
    ranks loads only its KV head from the slots P's whole blocks land in. The greedy text of
    p_md on every 4th prompt, and of p_rld_md with One-Shot and with Catch-Up on every 8th,
    equals a colocated vLLM run at TP 3 (MD's own configuration; all 20 prompts on every
    pipeline: run once, 2026-12-06, all equal); MD refuses no chunk, reports its degree in
    Health, and keeps the conversation in its DRC (only new blocks cross)."""
    some = prompts[::4]
    oracle = run_oracle([{"prompt_token_ids": p} for p in some], DTYPE, MAX_TOKENS, engine=TP3)
    with (_extra_worker("md", _settings(TP3), tmp_path / "md-tp3.log") as port,
          _router_over(served, {"md": port}) as (router, rows)):  # fmt: skip
        geometry = rows["md"]["geometry"]
        assert geometry["tensor_parallel_size"] == 3 and rows["md"]["admitted"]
        assert (geometry["kv_head_start"], geometry["kv_head_end"]) == (0, 3)  # every head
        for variant, hints in VARIANTS.items():
            step = 1 if variant == "p_md" else 2
            _assert_equal(router, hints, some[::step], oracle[::step], codec)
        _two_turns(served, router, port, "Notes on ranks. " + _long_text(26, 1))
        assert _stats_at(port).kv_refused_chunks == 0


def test_a_p_at_tensor_parallel_3_streams_whole_blocks(served, codec, prompts, oracle, tmp_path):
    """The reverse: P at TP 3 -> RLD and MD at TP 1. P prefills 64 tokens a step and streams
    each step's blocks as its three ranks copy their heads into the slots (posted once every
    rank's copy is in): the greedy text of p_md and of p_rld_md (Catch-Up) on every 4th prompt
    equals one engine's at TP 1 (RLD's and MD's configuration), and no chunk is refused."""
    refused = {w: stats(served, w).kv_refused_chunks for w in ("rld", "md")}
    with (_extra_worker("p", _settings(TP3), tmp_path / "p-tp3.log") as port,
          _router_over(served, {"p": port}) as (router, rows)):  # fmt: skip
        assert rows["p"]["geometry"]["tensor_parallel_size"] == 3
        for variant in ("p_md", "p_rld_md_catch_up"):
            _assert_equal(router, VARIANTS[variant], prompts[::4], oracle[::4], codec)
    assert {w: stats(served, w).kv_refused_chunks for w in ("rld", "md")} == refused


def _cpu_runs_fp8_kv() -> bool:
    """vLLM's CPU backend has an fp8 KV cache only on x86 with AVX-512 or AMX."""
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


@pytest.mark.skipif(not _cpu_runs_fp8_kv(), reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
def test_an_md_with_an_fp8_kv_cache_lands_ps_kv_narrowed(served, tmp_path):
    """P in float32 -> MD with vLLM's fp8 KV cache (engine.kv_cache_dtype fp8_e4m3, float32
    weights): admitted and paired (MD narrows P's blocks as they land), its slots a quarter of
    P's bytes; a two-turn conversation (p_rld_md, then p_md) is served, no chunk refused, and
    turn 2 finds turn 1's prompt in MD's DRC, so only the new blocks (P's bytes) cross. (How
    far its greedy text agrees with a colocated fp8 run: docs/benchmarks.md.)"""
    with (_extra_worker("md", ["kv_cache_dtype=fp8_e4m3"], tmp_path / "md-fp8.log") as port,
          _router_over(served, {"md": port}) as (router, rows)):  # fmt: skip
        geometry = rows["md"]["geometry"]
        assert (geometry["kv_dtype"], geometry["layout"]) == ("fp8_e4m3", "cpu_packed_kv")
        assert rows["md"]["admitted"]
        assert _stats_at(port).kv_block_bytes * 4 == stats(served, "p").kv_block_bytes
        _two_turns(served, router, port, "Notes on fp8. " + _long_text(28, 3))
        assert _stats_at(port).kv_refused_chunks == 0


def _settings(engine: dict) -> list[str]:
    return [f"{key}={value}" for key, value in engine.items()]


def _assert_equal(router, hints: dict, some: list, oracle: list, codec) -> None:
    """Every prompt of ``some`` through ``router`` on ``hints``' pipeline: the oracle's text."""
    bodies = at_once(lambda p: complete(router.url, p, hints), some)
    for prompt, expected, body in zip(some, oracle, bodies, strict=True):
        assert body["choices"][0]["text"] == codec.decode(expected["token_ids"]), (
            hints, len(prompt), body["pdd"])  # fmt: skip
        assert body["pdd"]["pipeline"] == hints["pipeline"]


def test_a_lossless_wan_codec_equals_single_engine(served, codec, prompts, oracle, tmp_path):
    """A P whose KV crosses to MD zstd-coded (transfer.wan_codec): p_md's greedy text
    equals one engine's on every prompt of the suite, fewer bytes cross than P's raw KV (P's
    counters of what was acknowledged and what went on the wire), and MD refuses no chunk.
    The requests carry a tenant of their own (an API key of tenant codec-NAME), so every
    prompt is new to MD's DRC and P sends every whole block. One lossless codec here (a P
    worker and the suite's prompts take ~70 s): lz4, and every codec on each transport, are
    byte-exact in tests/transfer/test_contract.py."""
    wan_codec = "zstd"
    keys = tmp_path / "keys"
    keys.write_text(f"sk-{wan_codec} tenant=codec-{wan_codec} admin\n")
    auth = {"Authorization": f"Bearer sk-{wan_codec}"}
    refused = stats(served, "md").kv_refused_chunks
    sets = (f"transfer.wan_codec={wan_codec}",)
    with (_extra_worker("p", [], tmp_path / "p.log", sets) as port,
          _router_over(served, {"p": port}, (f"router.api_keys_file={keys}",), auth)
          as (router, _)):  # fmt: skip

        def ask(prompt):
            body = {"model": load_config(CONFIG).model.name, "prompt": prompt, "temperature": 0,
                    "max_tokens": MAX_TOKENS, "pdd": VARIANTS["p_md"]}  # fmt: skip
            return httpx.post(f"{router.url}/completions", json=body, headers=auth, timeout=300)

        for prompt, expected, r in zip(prompts, oracle, at_once(ask, prompts), strict=True):
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["choices"][0]["text"] == codec.decode(expected["token_ids"]), (
                wan_codec, len(prompt), got["pdd"])  # fmt: skip
            assert got["pdd"]["md_cached_tokens"] == 0  # a tenant of its own: MD held nothing
        p_stats = _stats_at(port)  # p_md only: every byte P sent went to MD, coded
        assert 0 < p_stats.kv_wire_bytes_sent < p_stats.kv_bytes_sent
    assert stats(served, "md").kv_refused_chunks == refused


def test_recompute_or_wait_follows_the_link_md_s_prefill_is_weighed_against(served, codec,
                                                                             prompts, oracle,
                                                                             tmp_path):  # fmt: skip
    """router.pdd.md_recompute (the default) with a P that has not measured its WAN (a fresh
    engine, no warm-up: transfer.warmup_bytes 0), so the router's link figure is its config's:
    at 1 Mbit/s, with md_recompute_max_tokens above every prompt, MD computing a miss (at the
    prefill rate its engine measured as it started) is sooner than the KV crossing, so MD
    computes every prompt itself: p_md, greedy text equal to one engine's, no KV reaches MD.
    With a bound below every miss (md_recompute_max_tokens 16: while the KV lands, what is
    left never falls under a block) the longest prompt waits for its KV on the same 1 Mbit/s
    figure (its ~440 s are within the lifted budget, so the bound holds); at 1 Tbit/s (P has
    measured its link by then) a miss waits for its KV too (MD computes nothing). Each
    router's requests carry a tenant of their own, so every prompt is new to MD's DRC; the
    TTFT budget is lifted so every request stays p_md whatever this machine's speed."""
    keys = tmp_path / "keys"
    keys.write_text("".join(f"sk-{t} tenant={t} admin\n" for t in ("compute", "bound", "wait")))
    sets = (f"router.api_keys_file={keys}", "router.pdd.ttft_budget_s=600")

    def ask(router, prompt, key):
        body = {"model": load_config(CONFIG).model.name, "prompt": prompt, "temperature": 0,
                "max_tokens": MAX_TOKENS}  # fmt: skip
        r = httpx.post(f"{router.url}/completions", json=body, timeout=300,
                       headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()

    admin = {"Authorization": "Bearer sk-compute"}
    long, want = max(zip(prompts, oracle, strict=True), key=lambda po: len(po[0]))
    with _extra_worker("p", [], tmp_path / "p.log", ("transfer.warmup_bytes=0",)) as port:
        slow = (*sets, "router.pdd.wan_bandwidth_bps=1e6")
        unbounded = (*slow, "router.pdd.md_recompute_max_tokens=2048")
        with _router_over(served, {"p": port}, unbounded, admin) as (router, _):
            root = router.url.removesuffix("/v1")

            def md_rate():  # once the router polled MD's Stats: the rate it measured at start
                rows = httpx.get(root + "/debug/workers", timeout=5, headers=admin).json()
                (md,) = [w for w in rows["workers"] if w["id"] == "md"]
                return md.get("prefill", {}).get("tokens_per_s", 0) > 0

            wait_until(md_rate, 30, "MD's measured prefill rate in the router's view")
            received = stats(served, "md").kv_bytes_received
            for prompt, expected in zip(prompts, oracle, strict=True):
                got = ask(router, prompt, "sk-compute")
                assert got["choices"][0]["text"] == codec.decode(expected["token_ids"]), (
                    len(prompt), got["pdd"])  # fmt: skip
                rec = got["pdd"]
                assert (rec["pipeline"], rec["wan_kv_bytes"]) == ("p_md", 0), rec
                lacked = len(prompt) // 32 * 32 > rec["md_cached_tokens"]  # a whole block
                assert rec["md_computed"] == lacked, rec
            assert stats(served, "md").kv_bytes_received == received  # no KV reached MD
        bounded = (*slow, "router.pdd.md_recompute_max_tokens=16")
        fast = (*sets, "router.pdd.wan_bandwidth_bps=1e12")
        for tenant, figures in (("bound", bounded), ("wait", fast)):
            with _router_over(served, {"p": port}, figures, admin) as (router, _):
                got = ask(router, long, f"sk-{tenant}")
                assert got["choices"][0]["text"] == codec.decode(want["token_ids"])
                rec = got["pdd"]
                assert (rec["pipeline"], rec["md_computed"]) == ("p_md", False), (tenant, rec)
                assert rec["wan_kv_bytes"] > 0
                assert stats(served, "md").kv_bytes_received > received
                received = stats(served, "md").kv_bytes_received


# --- agentic clients: a tool conversation through the official openai client ---------------

TOOL_TURNS = [  # (user text or None, tool_choice, tool result for the call it gets)
    ('Call get_weather with the arguments {"city": "Paris"}.', "get_weather", "18 C, sunny"),
    (None, "get_time", "14:05"),
    (None, "none", None),
]


_RAW_CACHE: dict[str, str] = {}  # greedy text per prompt: every variant shares it


def _tool_turn_expected(served, codec, messages, choice):
    """What the router must answer: the hermes parse of the greedy text that the same prompt
    gives on /v1/completions (the prompt as the router renders it: tools, tool history and
    the opening of the named call; a named call's rest constrained by the same grammar, sent
    as guided_grammar)."""
    from pdd.engine.constraint import grammar_of
    from pdd.engine.types import ConstraintSpec
    from pdd.router.http.schemas import ChatMessage
    from pdd.router.http.validation import chat_messages
    from pdd.router.text.tool_calls import extract
    from pdd.router.text.tool_prompt import ToolPlan, call_constraint, prompt_ids, prompt_text

    plan = ToolPlan("hermes", (WEATHER, TIME), choice)
    msgs = chat_messages([ChatMessage.model_validate(m) for m in messages])
    ids = prompt_ids(codec, msgs, plan)
    kw = {"max_tokens": 48, "skip_special_tokens": not plan.parses}  # as the router sets it
    forced = call_constraint(plan)
    if forced is not None:  # the same grammar as the router's, as EBNF text
        kw["guided_grammar"] = str(grammar_of(ConstraintSpec(forced.kind, forced.spec)))
    key = json.dumps([ids, kw])
    if key not in _RAW_CACHE:
        _RAW_CACHE[key] = complete(served.url, ids, {"pipeline": "p_md"}, **kw)["choices"][0][
            "text"
        ]
    raw = _RAW_CACHE[key]
    found = extract("hermes", plan.forced_prefix + raw) if plan.parses else None
    return prompt_text(codec, msgs, plan), len(ids), raw, found


def _answer(client, messages, choice, pdd, stream):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    tc = (
        choice if choice in ("none", "auto") else {"type": "function", "function": {"name": choice}}
    )
    kw = {"model": load_config(CONFIG).model.name, "messages": messages, "tools": [WEATHER, TIME],
          "tool_choice": tc, "temperature": 0, "max_tokens": 48, "extra_body": {"pdd": pdd}}  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0], r.usage, r.model_extra["pdd"]
    state = ChatCompletionStreamState()
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    for c in chunks:
        state.handle_chunk(c)
    record = next(c.model_extra["pdd"] for c in chunks if c.choices and c.choices[0].finish_reason)
    # the accumulated snapshot: get_final_completion() refuses finish_reason "length"
    return state.current_completion_snapshot.choices[0], chunks[-1].usage, record


EVERY_CLIENT_PATH = [(v, s) for v in VARIANTS for s in (False, True)]  # streamed and not


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("variant", ["p_md", "p_rld_md_catch_up"])
def test_an_openai_agents_sdk_agent_calls_its_tool_and_answers(served, variant, stream):
    """The OpenAI Agents SDK (its default model: the Responses API, /v1/responses), streamed
    and not: an agent forced to call its function tool gets a call whose arguments the SDK
    parses and runs (the run ends on the tool's result); the next turn sends the whole run
    back as input items (the call and its output included) and gets a text answer."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )  # fmt: skip
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    client = AsyncOpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=300)
    model = OpenAIResponsesModel(model=load_config(CONFIG).model.name, openai_client=client)

    def settings(choice: str) -> ModelSettings:
        return ModelSettings(tool_choice=choice, temperature=0, max_tokens=48,
                             extra_body={"pdd": VARIANTS[variant]})  # fmt: skip

    async def run(agent: Agent, given: str | list):  # a RunResult, streamed or not
        if not stream:
            return await Runner.run(agent, given, max_turns=2)
        result = Runner.run_streamed(agent, given, max_turns=2)
        async for _ in result.stream_events():
            pass
        return result

    async def conversation():
        forced = Agent(name="weather", instructions="Use the weather tool.", model=model,
                       tools=[get_weather], model_settings=settings("get_weather"),
                       tool_use_behavior="stop_on_first_tool")  # fmt: skip
        first = await run(forced, "What is the weather in Paris?")
        talk = Agent(name="weather", instructions="Answer briefly.", model=model,
                     tools=[get_weather], model_settings=settings("none"))  # fmt: skip
        follow = [*first.to_input_list(), {"role": "user", "content": "Thanks! And so?"}]
        return first, await run(talk, follow)

    first, second = asyncio.run(conversation())
    assert len(cities) == 1 and cities[0]
    assert first.final_output == f"It is sunny in {cities[0]}."
    kinds = [item.get("type") for item in first.to_input_list()]
    assert "function_call" in kinds and "function_call_output" in kinds
    assert isinstance(second.final_output, str) and second.final_output.strip()
    assert len(cities) == 1  # tool_choice none: the second turn called nothing


@pytest.mark.parametrize(("variant", "stream"), EVERY_CLIENT_PATH)
def test_tool_conversation_call_result_call_answer(served, codec, variant, stream):
    """call -> result -> call -> answer on each pdd pipeline, streamed and not. Deterministic
    and honest: greedy float32; each answer must equal the parse of the raw greedy text of the
    same prompt (no claim that the small model calls tools well). Turn 1's prompt makes the
    model write a well-formed call, whose arguments must validate against the tool's schema.
    The forced call opening puts every token of a named call inside its arguments, so on
    p_rld_md the handoff happens inside them."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0)
    messages: list[dict] = []
    for turn, (user, choice, result) in enumerate(TOOL_TURNS):
        if user is not None:
            messages.append({"role": "user", "content": user})
        text, n_prompt, raw, found = _tool_turn_expected(served, codec, messages, choice)
        for call in [m for m in messages if m.get("tool_calls")]:  # the history is in the prompt
            fn = call["tool_calls"][0]["function"]
            assert (
                json.dumps({"name": fn["name"], "arguments": json.loads(fn["arguments"])}) in text
            )
        assert all(f"<tool_response>\n{m['content']}\n</tool_response>" in text
                   for m in messages if m["role"] == "tool")  # fmt: skip
        choice_out, usage, record = _answer(client, messages, choice, VARIANTS[variant], stream)
        assert (
            usage.prompt_tokens == n_prompt and record["pipeline"] == VARIANTS[variant]["pipeline"]
        )
        if "handoff" in VARIANTS[variant]:
            assert record["handoff"] in (VARIANTS[variant]["handoff"], "rld_finished")
        msg = choice_out.message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        if found is None:  # tool_choice none: the answer is text
            assert msg.content == raw and calls == []
            break
        if stream and not found.calls and calls and choice_out.finish_reason == "length":
            # The documented streaming exception (docs/architecture.md "Tool calls"): a call
            # cut by max_tokens after its header went out stays a call with the fragments sent.
            assert [n for n, _ in calls] == [choice], (raw, calls)
            messages.append({"role": "assistant", "content": found.content})
            continue
        assert [(n, json.loads(a)) for n, a in calls] == [
            (c.name, json.loads(c.arguments)) for c in found.calls
        ], (raw, record)
        assert (msg.content or None) == found.content
        schemas = {t["function"]["name"]: t["function"].get("parameters") for t in (WEATHER, TIME)}
        for n, a in calls:  # a forced call is constrained: its arguments always validate
            jsonschema.validate(json.loads(a), schemas[n] or {"type": "object"})
        if turn == 0:
            assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]
            assert choice_out.finish_reason == "tool_calls"
        if not calls:  # the model's text did not parse as a call: it came back as text
            messages.append({"role": "assistant", "content": msg.content})
            continue
        call_id = msg.tool_calls[0].id
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {
                "name": msg.tool_calls[0].function.name,
                "arguments": msg.tool_calls[0].function.arguments}}]})  # fmt: skip
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})


@pytest.mark.parametrize(("variant", "stream"), EVERY_CLIENT_PATH)
def test_a_langchain_agent_runs_the_tool_conversation_on_every_pipeline(served, codec, variant,
                                                                       stream):  # fmt: skip
    """The same call -> result -> call -> answer through an agent framework's OpenAI client
    (LangChain's ChatOpenAI, bind_tools; invoke, or stream with the chunks summed as LangChain
    users do) on each pipeline (on p_rld_md the handoff falls inside the forced calls'
    arguments): the calls come back as LangChain tool calls equal to the parse of the greedy
    text, their arguments validate, and the tool history LangChain sends (as it serializes it)
    reaches the rendered prompt."""
    import jsonschema
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    sent: list[dict] = []
    pipelines: list[str] = []
    http = httpx.Client(timeout=300, event_hooks={
        "request": [lambda r: sent.append(json.loads(r.content))],
        "response": [lambda r: pipelines.append(r.headers.get("x-pdd-pipeline", ""))]})  # fmt: skip
    llm = ChatOpenAI(base_url=served.url, api_key="unused", model=load_config(CONFIG).model.name,
                     temperature=0, max_tokens=48, max_retries=0, http_client=http,
                     extra_body={"pdd": VARIANTS[variant]})  # fmt: skip
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in (WEATHER, TIME)}
    history: list = []
    for turn, (user, choice, result) in enumerate(TOOL_TURNS):
        if user is not None:
            history.append(HumanMessage(user))
        agent = llm.bind_tools([WEATHER, TIME], tool_choice=choice)
        if stream:
            ai = None
            for chunk in agent.stream(history):
                ai = chunk if ai is None else ai + chunk
        else:
            ai = agent.invoke(history)
        assert ai is not None and sent[-1].get("stream", False) is stream
        assert pipelines[-1] == VARIANTS[variant]["pipeline"]
        messages = sent[-1]["messages"]  # what LangChain put on the wire
        text, _, raw, found = _tool_turn_expected(served, codec, messages, choice)
        for m in messages:
            for c in m.get("tool_calls") or []:
                fn = c["function"]
                call = {"name": fn["name"], "arguments": json.loads(fn["arguments"])}
                assert json.dumps(call) in text
            if m["role"] == "tool":
                assert f"<tool_response>\n{m['content']}\n</tool_response>" in text
        if found is None:  # tool_choice none: the answer is text
            assert ai.content == raw and ai.tool_calls == []
            break
        named = [c["name"] for c in [*ai.tool_calls, *ai.invalid_tool_calls]]
        cut = ai.response_metadata.get("finish_reason") == "length"
        if stream and not found.calls and named and cut:
            # the documented streaming exception (see the openai client test above)
            assert named == [choice], (raw, named)
            history.append(AIMessage(found.content or ""))
            continue
        calls = [(c["name"], c["args"]) for c in ai.tool_calls]
        assert calls == [(c.name, json.loads(c.arguments)) for c in found.calls], raw
        for name, args in calls:
            jsonschema.validate(args, schemas[name] or {"type": "object"})
        if turn == 0:
            assert calls == [("get_weather", {"city": "Paris"})]
        history.append(ai)
        if ai.tool_calls:
            history.append(ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"]))
    assert len(sent) == len(TOOL_TURNS)
    http.close()


# --- structured outputs: json_schema on every pipeline, across the handoff ------------------

SCHEMA_MAX_TOKENS = 96
SCHEMAS = [  # (question, schema): required fields, nested objects, enums, arrays
    ("Describe a person called Ana, age 31, as JSON.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
      "age": {"type": "integer"}}, "required": ["name", "age"]}),
    ("Give a city and its country as JSON.",
     {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
      "country": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
       "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]}},
       "required": ["name", "continent"]}}, "required": ["city", "country"]}),
    ("List three primary colors as JSON.",
     {"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
      "items": {"enum": ["red", "green", "blue", "yellow"]}}}, "required": ["colors"]}),
    ("Is the sky blue? Answer as JSON.",
     {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
      "confidence": {"type": "number"}}, "required": ["answer", "confidence"]}),
    ("Make a shopping list of two items as JSON.",
     {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
      "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
       "qty": {"type": "integer"}}, "required": ["name", "qty"]}}}, "required": ["items"]}),
    ("Describe a book with its title and year as JSON.",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
      "year": {"type": "integer"}}, "required": ["title", "year"]}),
    ("Give tomorrow's weather forecast as JSON.",
     {"type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
      "temperature_c": {"type": "integer"}}, "required": ["sky", "temperature_c"]}),
    ("Name two animals and the sounds they make as JSON.",
     {"type": "object", "properties": {"animals": {"type": "array", "minItems": 1, "maxItems": 2,
      "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
       "sound": {"type": "string", "maxLength": 12}}, "required": ["name", "sound"]}}},
      "required": ["animals"]}),
    ("Describe a car as JSON.",
     {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 16},
      "color": {"enum": ["red", "blue", "black", "white", "silver"]},
      "electric": {"type": "boolean"}}, "required": ["brand", "color", "electric"]}),
    ("Give a user profile with a postal address as JSON.",
     {"type": "object", "properties": {"user": {"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 16}, "address": {"type": "object", "properties": {
       "street": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "maxLength": 8}},
       "required": ["street", "zip"]}}, "required": ["name", "address"]}}, "required": ["user"]}),
    ("Rate the movie Up from 1 to 5 as JSON.",
     {"type": "object", "properties": {"rating": {"enum": [1, 2, 3, 4, 5]},
      "comment": {"type": "string", "maxLength": 24}}, "required": ["rating", "comment"]}),
    ("List the days of the weekend as JSON.",
     {"type": "object", "properties": {"days": {"type": "array", "minItems": 1, "maxItems": 2,
      "items": {"enum": ["Saturday", "Sunday", "Monday"]}}}, "required": ["days"]}),
    ("Describe a meeting with its time and up to three attendees as JSON.",
     {"type": "object", "properties": {"time": {"type": "string", "maxLength": 8},
      "attendees": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}},
      "required": ["time", "attendees"]}),
    ("Report the status of a web server as JSON.",
     {"type": "object", "properties": {"status": {"enum": ["up", "down", "degraded"]},
      "uptime_hours": {"type": "integer"}, "tags": {"type": "array", "maxItems": 2,
       "items": {"type": "string", "maxLength": 10}}}, "required": ["status", "uptime_hours"]}),
    ("Translate the word hello into French and Spanish as JSON.",
     {"type": "object", "properties": {"french": {"enum": ["bonjour", "salut", "merci"]},
      "spanish": {"enum": ["hola", "buenos dias", "gracias"]}}, "required": ["french", "spanish"]}),
    ("Describe a pet as JSON.",
     {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird", "fish"]},
      "name": {"type": "string", "maxLength": 12}, "vaccinated": {"type": "boolean"}},
      "required": ["kind", "name"]}),
    ("Give a recipe with two ingredients as JSON.",
     {"type": "object", "properties": {"dish": {"type": "string", "maxLength": 20},
      "ingredients": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object",
       "properties": {"item": {"type": "string", "maxLength": 12}, "grams": {"type": "integer"}},
       "required": ["item", "grams"]}}}, "required": ["dish", "ingredients"]}),
    ("What is 2 plus 3? Answer as JSON.",
     {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 12},
      "result": {"type": "integer"}}, "required": ["expression", "result"]}),
    ("Make a to-do list of two tasks with priorities as JSON.",
     {"type": "object", "properties": {"tasks": {"type": "array", "minItems": 1, "maxItems": 2,
      "items": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 16},
       "priority": {"enum": ["low", "medium", "high"]}}, "required": ["title", "priority"]}}},
      "required": ["tasks"]}),
    ("Describe the planet Saturn as JSON.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
      "moons": {"type": "integer"}, "rings": {"type": "boolean"},
      "type": {"enum": ["rocky", "gas", "ice"]}}, "required": ["name", "moons", "rings", "type"]}),
]  # fmt: skip
assert len(SCHEMAS) == 20


PENALTIES = {"presence_penalty": 0.6, "frequency_penalty": 1.0}
BANNED_WORDS = [f"{s}{w}" for w in ("red", "Red", "blue", "Blue") for s in ("", " ")]


def sampled(codec) -> list[tuple[str, dict]]:
    """Questions with sampling settings beyond greedy: presence and frequency penalties, and
    a logit_bias that bans the first token of each spelling of two primary colours; bad_words
    that ban a two-token word the model would write."""
    banned = {str(codec.encode(w, add_special_tokens=False)[0]): -100 for w in BANNED_WORDS}
    return [("List five fruits, then list the same five again.", PENALTIES),
            ("Say the word river ten times.", PENALTIES),
            ("Name the three primary colors of paint.", {"logit_bias": banned}),
            # greedy answers "... the Eiffel Tower": " E" + "iffel", two tokens, banned
            ("Name a famous tower in Paris.", {"bad_words": ["Eiffel"]})]  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_json_schema_outputs_validate_and_equal_vllms_own(served, oracles, variant):
    """response_format json_schema on p_md and p_rld_md (One-Shot, Catch-Up): every answer
    parses and validates, and equals vLLM's own structured output of one engine (float32,
    greedy), so the constraint resumed exactly on each tier. P's token is the JSON's first,
    so every later tier (RLD, MD after the handoff) resumes inside the JSON."""
    import jsonschema

    def ask(question_schema):
        question, schema = question_schema
        rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
              "strict": True}}  # fmt: skip
        body = {"model": load_config(CONFIG).model.name, "temperature": 0,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": SCHEMA_MAX_TOKENS, "response_format": rf,
                "pdd": VARIANTS[variant]}  # fmt: skip
        return httpx.post(f"{served.url}/chat/completions", json=body, timeout=300)

    handed_inside = 0
    answers = at_once(ask, SCHEMAS)
    for (_, schema), want, r in zip(SCHEMAS, oracles["schema"], answers, strict=True):
        assert r.status_code == 200, r.text
        out, record = r.json(), r.json()["pdd"]
        text = out["choices"][0]["message"]["content"]
        assert out["choices"][0]["finish_reason"] == "stop", (text, record)
        jsonschema.validate(json.loads(text), schema)
        assert text == want["text"], (variant, record)
        n = out["usage"]["completion_tokens"]
        if record["pipeline"] == "p_rld_md" and record["handoff"] != "rld_finished":
            # MD wrote the JSON's rest after P's token and RLD's ones. On one host MD's KV
            # often lands before RLD emits any (rld_tokens 0: MD resumes after P's token).
            handed_inside += int(1 + record["rld_tokens"] < n)
    if variant != "p_md":
        assert handed_inside >= 1, "no handoff fell inside a JSON answer"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_penalties_logit_bias_and_bad_words_hold_on_every_tier(served, codec, oracles, variant):
    """Greedy with presence and frequency penalties, a logit_bias, bad_words: each pipeline's
    answer equals one vLLM engine's, so every tier after P's token counted the tokens earlier
    tiers emitted (``prior_output_tokens``, pdd.engine.penalties and pdd.engine.bad_words)
    instead of restarting, and applied the bias (none of the banned tokens in the answer)."""

    def ask(question_settings):
        question, settings = question_settings
        body = {"model": load_config(CONFIG).model.name, "temperature": 0, **settings,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": SCHEMA_MAX_TOKENS, "pdd": VARIANTS[variant]}  # fmt: skip
        return httpx.post(f"{served.url}/chat/completions", json=body, timeout=300)

    questions = sampled(codec)
    answers = at_once(ask, questions)
    for (_, settings), want, r in zip(questions, oracles["sampled"], answers, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want["text"], r.json()["pdd"]
        banned = {int(t) for t in settings.get("logit_bias", {})}
        assert not banned & set(want["token_ids"])
        assert not any(w in want["text"] for w in settings.get("bad_words", []))


@pytest.mark.parametrize("variant", [*VARIANTS, "pd_wan"])
def test_echo_and_prompt_logprobs_equal_one_engines(
    served, baselines, codec, prompts, oracles, variant
):
    """lm-eval's loglikelihood request (a completion with echo, logprobs, temperature 0) on
    every pipeline: the echoed prompt's logprobs are P's (it computes the whole prompt for
    them, its prefix cache unread) and equal one engine's (float32, within 1e-3), the answer
    after them too; vLLM's prompt_logprobs carry the same values."""
    url = baselines["pd_wan"] if variant == "pd_wan" else served.url
    pdd = {} if variant == "pd_wan" else {"pdd": VARIANTS[variant]}
    model = load_config(CONFIG).model.name
    for ids, want in zip(echoed(prompts), oracles["echo"], strict=True):
        body = {"model": model, "prompt": ids, "echo": True, "logprobs": 1, "temperature": 0,
                "max_tokens": MAX_TOKENS, **pdd}  # fmt: skip
        r = httpx.post(f"{url}/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice, n = r.json()["choices"][0], len(ids)
        assert choice["text"] == codec.decode(ids, skip_special_tokens=False) + want["text"]
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == n + len(want["token_ids"])
        assert got[1:n] == pytest.approx(want["prompt_logprobs"], abs=1e-3)
        assert got[n:] == pytest.approx(want["logprobs"], abs=1e-3)
        body = {"model": model, "prompt": ids, "prompt_logprobs": 0, "max_tokens": 2, **pdd}
        r = httpx.post(f"{url}/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        positions = r.json()["choices"][0]["prompt_logprobs"]
        own = [p[str(t)]["logprob"] for p, t in zip(positions[1:], ids[1:], strict=True)]
        assert positions[0] is None and own == pytest.approx(want["prompt_logprobs"], abs=1e-3)


def test_a_seeded_request_is_reproducible_on_p_md(served):
    """The documented limit of seeded sampling (README, "Sampling across tiers"): each tier
    change restarts vLLM's seeded generator, so a seeded answer is reproducible where the tier
    changes at the same token every time: p_md (always after P's first token)."""
    body = {"model": load_config(CONFIG).model.name, "temperature": 0.9, "seed": 7,
            "messages": [{"role": "user", "content": "Tell me a short story."}],
            "max_tokens": 24, "pdd": {"pipeline": "p_md"}}  # fmt: skip
    texts = []
    for _ in range(2):
        r = httpx.post(f"{served.url}/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] and texts[0]


def test_several_seeded_choices_are_the_seeds_one_by_one_on_p_md(served):
    """n=2 with seed 7 samples as vLLM's parallel sampling does: choice i is the request
    with seed 7 + i (each choice a request of its own, reproducible on p_md as above)."""
    body = {"model": load_config(CONFIG).model.name, "temperature": 0.9, "max_tokens": 24,
            "prompt": "Once upon a time", "pdd": {"pipeline": "p_md"}}  # fmt: skip
    r = httpx.post(f"{served.url}/completions", json={**body, "n": 2, "seed": 7}, timeout=300)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    for i, text in enumerate(texts):
        one = httpx.post(f"{served.url}/completions", json={**body, "seed": 7 + i}, timeout=300)
        assert one.status_code == 200, one.text
        assert one.json()["choices"][0]["text"] == text
    assert texts[0] != texts[1]


def test_a_schema_the_backend_refuses_is_a_400_naming_the_parameter(served):
    """The worker's grammar backend refuses it (P is the first to see it): 400, with the
    parameter named, never a 500."""
    for extra, param in (
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "nope"}}}}, "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ):  # fmt: skip
        body = {"model": load_config(CONFIG).model.name, "prompt": "Hi", "max_tokens": 4,
                **extra}  # fmt: skip
        r = httpx.post(f"{served.url}/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("variant", ["p_md", "p_rld_md_one_shot"])
def test_choice_and_regex_hold_from_p_to_md(served, variant):
    """guided_choice and guided_regex, completions API: P's token, then RLD and MD resume."""
    import re

    name = load_config(CONFIG).model.name
    base = {"model": name, "temperature": 0, "max_tokens": 24, "pdd": VARIANTS[variant]}
    r = httpx.post(f"{served.url}/completions", timeout=300, json={
        **base, "prompt": "The best season is", "guided_choice": ["summer", "winter"]})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("summer", "winter"), r.text
    r = httpx.post(f"{served.url}/completions", timeout=300, json={
        **base, "prompt": "A date: ", "guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.json()["choices"][0]["text"])


def test_a_killed_worker_is_restarted_and_serving_goes_on(served, codec):
    """MD SIGKILLed in the middle of a p_md stream: the stream still completes with the text of
    a healthy run (another tier continues prompt + emitted), `pdd serve` starts MD again (the
    router and the other workers keep running), and once MD is back the next 10 requests
    succeed. Last in the module: it restarts a worker."""
    prompt = codec.encode(_long_text(8, 2) + "\nSummary:")
    want = complete(served.url, prompt, {"pipeline": "p_md"}, max_tokens=96, ignore_eos=True)
    victim = _worker_process(served, "md")
    body = {"model": load_config(CONFIG).model.name, "prompt": prompt, "temperature": 0,
            "max_tokens": 96, "ignore_eos": True, "stream": True, "pdd": {"pipeline": "p_md"}}  # fmt: skip
    text, chunks, record = [], 0, None
    with httpx.stream("POST", f"{served.url}/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk.get("choices") or []:
                text.append(c.get("text") or "")
            record = chunk.get("pdd") or record
            chunks += 1
            if chunks == 8:
                victim.kill()  # SIGKILL, mid-stream
    assert "".join(text) == want["choices"][0]["text"]
    assert record["pipeline"] == "p_md"
    wait_until(lambda: not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE,
               30, "the killed MD gone")  # fmt: skip
    wait_until(lambda: "starting md again" in served.log_tail(400), 60, "the restart of md")
    wait_until(lambda: _healthy(served), 600, "md back and healthy")
    assert _worker_process(served, "md").pid != victim.pid
    workers = httpx.get(served.url.removesuffix("/v1") + "/health", timeout=10).json()
    restarts = {w["id"]: w["restarts"] for w in workers["workers"]}
    assert [restarts[w] for w in WORKERS] == [0, 0, 1], restarts
    for i in range(10):
        out = complete(served.url, codec.encode(f"Request {i}: the capital of France is"))
        assert out["usage"]["completion_tokens"] > 0
