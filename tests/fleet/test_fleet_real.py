"""The real 2 P + 2 RLD + 2 MD fleet on one host (`pdd serve --config configs/fleet.yaml`,
real vLLM engines, started once for the module): multi-turn conversations stay on the MD
that holds their history, first turns spread over both Ps and both MDs, nothing fails.

8 conversations x 4 turns (prompts of ~300-500 tokens, 16 output tokens, greedy), 4 at a
time. Every response's `pdd` record names the instances that served it.
"""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from tests.helpers import serve, stop, wait_until

pytestmark = pytest.mark.slow

CONFIG = "configs/fleet.yaml"
WORKERS = ["p0", "p1", "rld0", "rld1", "md0", "md1"]
CONVERSATIONS, TURNS, CONCURRENCY, MAX_TOKENS = 8, 4, 4, 16
WORDS = ("river valley mill bridge engineer beam winter storm market trader silver spice "
         "library map stair garden harbor ship lantern orchard meadow forge anvil tower "
         "clock village baker candle thread loom pottery kiln").split()  # fmt: skip


def opening(i: int) -> str:
    """A different ~300-token document per conversation (seeded: the same every run)."""
    rng = random.Random(i)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(22)]
    return f"Conversation {i}. Read these notes: " + " ".join(sentences)


@pytest.fixture(scope="module")
def fleet():
    served = serve(CONFIG, WORKERS, timeout_s=480)  # 6 engines on 2 shared cores
    try:
        root = served.url.removesuffix("/v1")
        wait_until(lambda: all(w["healthy"] for w in
                               httpx.get(root + "/debug/workers", timeout=5).json()["workers"]),
                   60, "every fleet worker healthy")  # fmt: skip
        yield served
    finally:
        assert stop(served) == 0, served.log_tail()


def converse(client: OpenAI, i: int) -> list[dict]:
    """One conversation's turns, in order; each turn's `pdd` record."""
    messages = [{"role": "user", "content": opening(i) + " What is the first word?"}]
    records = []
    for turn in range(TURNS):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
        records.append(r.model_extra["pdd"])
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "user", "content": f"Turn {turn + 2}: and the next word?"})
    return records


def test_conversations_stay_on_their_md_and_load_is_balanced(fleet):
    client = OpenAI(base_url=fleet.url, api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        convs = list(pool.map(lambda i: converse(client, i), range(CONVERSATIONS)))
    # zero errors: every turn of every conversation came back (an error raises above)
    assert [len(c) for c in convs] == [TURNS] * CONVERSATIONS
    follow_ups = [(prev, cur) for c in convs for prev, cur in zip(c, c[1:], strict=False)]
    on_their_md = [
        cur["md"] == prev["md"] and cur["md_cached_tokens"] >= prev["prompt_tokens"] // 2
        for prev, cur in follow_ups
    ]
    assert sum(on_their_md) >= 0.95 * len(follow_ups), follow_ups
    firsts = [c[0] for c in convs]
    by_md, by_p = Counter(r["md"] for r in firsts), Counter(r["p"] for r in firsts)
    assert set(by_md) == {"md0", "md1"} and min(by_md.values()) >= CONVERSATIONS // 4, by_md
    assert set(by_p) == {"p0", "p1"} and min(by_p.values()) >= CONVERSATIONS // 4, by_p
    # every record names real instances of the role it stands for
    for r in (r for c in convs for r in c):
        assert r["p"] in ("p0", "p1") and r["md"] in ("md0", "md1")
        assert r["rld"] in (None, "rld0", "rld1")
        assert (r["rld"] is None) == (r["pipeline"] == "p_md")
