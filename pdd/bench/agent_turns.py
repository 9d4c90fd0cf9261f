"""Agent turns on the lab (issue 16, item 6): does MD learn a conversation's prefix when RLD
ends its short turns before their KV lands?

    sudo .venv/bin/pdd serve --config configs/lab.yaml &
    sudo .venv/bin/pdd bench agent-turns --url http://10.77.0.6:8000/v1 --conversations 3

Each conversation: a cold prompt of --cold-words words (~3.6 tokens a word), then --turns - 1
turns that re-send the history with the answer and --new-words more words (~64 tokens: a
tool call's result), --tokens greedy tokens each (ignore_eos), pipelines chosen by the router,
back to back or --think-s seconds apart (the agent's tool running; a deferred transfer then
has the link to itself). Per turn: the pipeline, MD's cached tokens, RLD's tokens, the handoff. Per
conversation, once the fleet is quiet (nothing pinned or open, MD's received bytes steady):
RLD's share of the tokens, and MD's received KV bytes against the final prompt's raw KV (the
cold turn's ``wan_kv_raw_bytes`` per block). --one-off marks every turn ``"one_off": true``
(the transfer is cut when RLD finishes first: the behaviour before item 6). Writes
results/agent-turns/results.json and md_cached.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx


def _kv_planes(url: str) -> dict[str, dict]:
    rows = httpx.get(url.removesuffix("/v1") + "/debug/workers", timeout=10).json()["workers"]
    return {w["id"]: w | w.get("kv_plane", {}) for w in rows}


def quiet_kv_planes(url: str, timeout_s: float = 300) -> dict[str, dict]:
    """Each worker's row and KV plane (by id), once nothing is pinned or open anywhere and
    MD's received bytes stopped moving: three equal readings 1.5 s apart (the router polls
    Stats every second), within ``timeout_s``. A transfer still crawling keeps moving."""
    deadline, same, last = time.monotonic() + timeout_s, 0, None
    while time.monotonic() < deadline:
        planes = _kv_planes(url)
        kv = [p for p in planes.values() if "pinned_slots" in p]
        quiet = all(p["pinned_slots"] == 0 and p["open_transfers"] == 0 for p in kv)
        got = _md_bytes(planes)
        same = same + 1 if quiet and got == last else 0
        if same >= 2:
            return planes
        last = got
        time.sleep(1.5)
    raise RuntimeError(f"the fleet's KV planes never went quiet in {timeout_s:g} s: {planes}")


def _md_bytes(planes: dict[str, dict]) -> int:
    return sum(p["bytes_received"] for p in planes.values() if p["role"] == "main_decode")


def _ask(url: str, model: str, prompt: str, tokens: int, one_off: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "pdd": {"one_off": True} if one_off else {}}  # fmt: skip
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json() | {"e2e_s": time.perf_counter() - t0}


def conversation(args: argparse.Namespace, after_turn: Callable[[int], None] | None = None) -> dict:
    """One agent conversation of ``args.turns`` turns; ``after_turn(k)`` runs once turn ``k``
    (from 0) answered, before the next is sent."""
    before = _md_bytes(quiet_kv_planes(args.url))
    prompt = f"Conversation {uuid.uuid4().hex[:8]}: " + " ".join(
        f"a{i}" for i in range(args.cold_words)
    )
    turns = []
    for k in range(args.turns):
        out = _ask(args.url, args.model, prompt, args.tokens, args.one_off)
        rec = out["pdd"]
        turns.append({
            "id": out["id"], "prompt_tokens": out["usage"]["prompt_tokens"],
            "pipeline": rec["pipeline"],
            "md_cached_tokens": rec["md_cached_tokens"], "rld_tokens": rec["rld_tokens"],
            "handoff": rec["handoff"], "md_computed": rec["md_computed"],
            "wan_kv_bytes": rec["wan_kv_bytes"], "wan_kv_raw_bytes": rec["wan_kv_raw_bytes"],
            "completion_tokens": out["usage"]["completion_tokens"], "e2e_s": out["e2e_s"],
        })  # fmt: skip
        print(json.dumps(turns[-1]), flush=True)
        if after_turn is not None:
            after_turn(k)
        if k + 1 < args.turns:
            more = " ".join(f"t{k}x{j}" for j in range(args.new_words))
            prompt += out["choices"][0]["text"] + " " + more
            time.sleep(args.think_s)  # the agent's tool runs meanwhile
    received = _md_bytes(quiet_kv_planes(args.url)) - before
    cold = turns[0]
    block = args.block_size
    per_token = cold["wan_kv_raw_bytes"] / max(cold["prompt_tokens"] // block * block, 1)
    final_kv = turns[-1]["prompt_tokens"] // block * block * per_token
    tokens = sum(t["completion_tokens"] for t in turns)
    return {
        "turns": turns,
        "rld_token_share": sum(t["rld_tokens"] for t in turns) / max(tokens, 1),
        "md_received_bytes": received,
        "final_prompt_kv_bytes": final_kv,
        "wan_over_final_kv": received / final_kv if final_kv else None,
        "last_prompt": prompt,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="router base URL ending in /v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=5, help="the cold one included")
    ap.add_argument("--cold-words", type=int, default=560)
    ap.add_argument("--new-words", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=32, help="MD's KV block (tokens)")
    ap.add_argument("--one-off", action="store_true", help='mark every turn "one_off"')
    ap.add_argument("--think-s", type=float, default=0.0,
                    help="seconds between a turn's answer and the next turn (a tool running)")  # fmt: skip
    ap.add_argument("--out", default="results/agent-turns")
    args = ap.parse_args(argv)
    runs = [conversation(args) for _ in range(args.conversations)]
    for run in runs:
        brief = {k: run[k] for k in ("rld_token_share", "wan_over_final_kv")}
        print(json.dumps(brief | {"pipelines": [t["pipeline"] for t in run["turns"]]}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    plot(runs, out / "md_cached.png")
    return 0


def plot(runs: list[dict], path: Path) -> None:
    """Per turn, the share of its prompt MD already held, one line per conversation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, run in enumerate(runs):
        turns = run["turns"]
        share = [t["md_cached_tokens"] / t["prompt_tokens"] for t in turns]
        ax.plot(range(1, len(turns) + 1), share, marker="o", label=f"conversation {i + 1}")
        for k, t in enumerate(turns):
            ax.annotate(t["pipeline"], (k + 1, share[k]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt MD held (md_cached / prompt)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Agent turns: MD learning the prefix")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
