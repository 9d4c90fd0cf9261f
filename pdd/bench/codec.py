"""`pdd bench codec`: the WAN codecs on real KV of the default model.

    pdd bench codec --out docs/results/codec [--prompts 50] [--tokens 128] [--dtype float32]
                    [--block 32]

Per prompt of a mix (chat, code, long documents: pdd's own sources and docs), the default
model (Hugging Face transformers on this CPU, one thread; no vLLM engine) prefills the
prompt's whole blocks; each block, in the bytes of vLLM's CPU cache (`cpu_packed_kv`: per
layer and KV head, K transposed [head_dim, block] then V [block, head_dim]; the layout P's
chunks carry), goes through every codec's encode and decode exactly as a transport chunk does
(pdd.transfer.wire.encode_chunk / decode_chunk). The decoded blocks replace the cache, the tail
tokens are computed from them (as MD does: extend-decode) and the model decodes greedily
(once per distinct decoded KV: a lossless stage on top of a codec decodes to the same bytes,
so the same tokens).
Per codec: wire ratio (wire / raw bytes), encode and decode GB/s of raw bytes on one core
(thread CPU time), and quality against `none`: greedy-token agreement (positions equal),
the first divergence, and the mean absolute difference of the chosen tokens' logprobs
(positions before the first divergence). Writes <out>/results.json and <out>/codec.png.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pdd.kv_geometry import LAYOUT_CPU_PACKED
from pdd.transfer.codec import NAME_OF, NAMES, CodecId
from pdd.transfer.wire import Chunk, ChunkHeader, decode_chunk, encode_chunk

ROOT = Path(__file__).resolve().parents[2]
MAX_PROMPT = 1536  # tokens: the lab's cold prompts
QUESTIONS = [
    "How do I plan a two-week trip to Japan in spring on a budget?",
    "Explain the difference between TCP and UDP to a new engineer.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the pros and cons of remote work for a small startup?",
    "Summarize the causes of the French Revolution in a few paragraphs.",
]


def prompts(n: int, tokenizer, block: int) -> list[tuple[str, list[int]]]:
    """`n` prompts cycling chat / code / document, each at least two blocks long."""
    code = sorted((ROOT / "pdd").rglob("*.py"))
    docs = sorted((ROOT / "docs").rglob("*.md"))
    out: list[tuple[str, list[int]]] = []
    i = 0
    while len(out) < n:
        kind = ("chat", "code", "doc")[i % 3]
        if kind == "chat":
            turns = [{"role": "user", "content": QUESTIONS[(i // 3 + j) % 5]} for j in range(6)]
            reply = {"role": "assistant", "content": " ".join(QUESTIONS[::-1]).replace("?", ".")}
            msgs = [m for t in turns for m in (t, reply)]
            text = tokenizer.apply_chat_template(msgs[:-1], tokenize=False)
        else:
            files = code if kind == "code" else docs
            text = files[(i // 3) % len(files)].read_text()[:9000]
        ids = tokenizer(text).input_ids[:MAX_PROMPT]
        if len(ids) >= 2 * block + 1:
            out.append((kind, ids))
        i += 1
    return out


def blocks_of(cache, n_blocks: int, block: int) -> list[np.ndarray]:
    """The cache's first n_blocks as raw bytes of vLLM's CPU layout: per layer and KV head,
    K transposed [D, B], then V [B, D]."""
    out = []
    for b in range(n_blocks):
        sl = slice(b * block, (b + 1) * block)
        kv = torch.stack(
            [
                torch.cat(
                    [
                        ly.keys[0, :, sl].transpose(-1, -2).flatten(1),
                        ly.values[0, :, sl].flatten(1),
                    ],
                    dim=-1,
                )
                for ly in cache.layers
            ]
        )  # [layers, kv_heads, 2*B*D]
        out.append(kv.contiguous().view(torch.uint8).numpy().reshape(-1).copy())
    return out


def put_blocks(cache, blocks: list[np.ndarray], dtype: torch.dtype, shape) -> None:
    layers, heads, block, width = shape
    hd = width // 2
    for b, raw in enumerate(blocks):
        kv = torch.from_numpy(raw).view(dtype).reshape(layers, heads, 2, block * hd)
        sl = slice(b * block, (b + 1) * block)
        for li, ly in enumerate(cache.layers):
            ly.keys[0, :, sl] = kv[li, :, 0].reshape(heads, hd, block).transpose(-1, -2)
            ly.values[0, :, sl] = kv[li, :, 1].reshape(heads, block, hd)


def greedy(model, cache, tail: list[int], tokens: int) -> tuple[list[int], list[float]]:
    ids, logprobs = [], []
    x = torch.tensor([tail])
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(x, past_key_values=cache, use_cache=True).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            t = int(lp.argmax())
            ids.append(t)
            logprobs.append(float(lp[t]))
            x = torch.tensor([[t]])
    return ids, logprobs


def codec_pass(codec: CodecId, blocks, dtype: str, shape, stats: dict) -> list[np.ndarray]:
    """Encode and decode every block as one transport chunk; accumulates bytes and CPU time."""
    out = []
    for raw in blocks:
        header = ChunkHeader(0, "b", 0, 1, 0, 0, 1, 0, shape[0], dtype, shape, 0, raw.nbytes,
                             raw.nbytes, raw.nbytes, codec=codec,
                             layout=LAYOUT_CPU_PACKED)  # fmt: skip
        t0 = time.thread_time()
        sent, payload = encode_chunk(Chunk(header, memoryview(raw)))
        wire = bytes(payload)
        t1 = time.thread_time()
        dest = np.empty_like(raw)
        decode_chunk(sent, wire, memoryview(dest))
        t2 = time.thread_time()
        stats["raw"] += raw.nbytes
        stats["wire"] += len(wire)
        stats["enc_s"] += t1 - t0
        stats["dec_s"] += t2 - t1
        out.append(dest)
    return out


def quality(base: tuple[list[int], list[float]], run: tuple[list[int], list[float]]) -> dict:
    (b_ids, b_lp), (r_ids, r_lp) = base, run
    same = [a == b for a, b in zip(b_ids, r_ids, strict=True)]
    first = same.index(False) if False in same else len(same)
    diffs = [abs(a - b) for a, b in zip(b_lp[:first], r_lp[:first], strict=True)]
    return {"agree": sum(same), "tokens": len(same), "first_divergence": first,
            "logprob_abs_diff_sum": sum(diffs), "logprob_n": len(diffs)}  # fmt: skip


def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdd.config import ModelConfig
    from pdd.engine.model import prepare_model

    torch.set_num_threads(1)
    path = prepare_model(ModelConfig(dtype=args.dtype))
    tdtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype).eval()
    codecs = [NAMES[c] for c in args.codecs.split(",")]
    stats = {c: {"raw": 0, "wire": 0, "enc_s": 0.0, "dec_s": 0.0} for c in codecs}
    qual = {c: [] for c in codecs}
    kinds = []
    block = args.block
    for kind, ids in prompts(args.prompts, tok, block):
        n_blocks = (len(ids) - 1) // block  # MD computes at least the last prompt token
        head, tail = ids[: n_blocks * block], ids[n_blocks * block :]
        with torch.no_grad():
            prefill = model(torch.tensor([head]), use_cache=True).past_key_values
        blocks = blocks_of(prefill, n_blocks, block)
        _, kv_heads, _, head_dim = prefill.layers[0].keys.shape
        shape = (len(prefill.layers), kv_heads, block, 2 * head_dim)
        base, runs = None, {}  # decoded KV -> its greedy run: equal KV, equal tokens
        for c in codecs:
            decoded = codec_pass(c, blocks, args.dtype, shape, stats[c])
            key = hashlib.sha256(b"".join(d.tobytes() for d in decoded)).digest()
            if key not in runs:  # a lossless stage on top decodes to the same KV
                cache = copy.deepcopy(prefill)
                put_blocks(cache, decoded, tdtype, shape)
                runs[key] = greedy(model, cache, tail, args.tokens)
            out = runs[key]
            base = out if c is CodecId.NONE else base
            qual[c].append(quality(base, out) if base is not None else None)
        kinds.append(kind)
        print(f"prompt {len(kinds)}: {kind}, {n_blocks} blocks", file=sys.stderr, flush=True)
    return summarize(args, codecs, stats, qual, kinds)


def summarize(args, codecs, stats, qual, kinds) -> dict:
    rows = {}
    for c in codecs:
        s, q = stats[c], [x for x in qual[c] if x is not None]
        n = sum(x["tokens"] for x in q)
        lp_n = sum(x["logprob_n"] for x in q)
        rows[NAME_OF[c]] = {
            "wire_ratio": s["wire"] / s["raw"],
            "encode_GBps_one_core": s["raw"] / max(s["enc_s"], 1e-9) / 1e9,
            "decode_GBps_one_core": s["raw"] / max(s["dec_s"], 1e-9) / 1e9,
            "greedy_agreement": sum(x["agree"] for x in q) / n if n else None,
            "first_divergence_median": float(np.median([x["first_divergence"] for x in q]))
            if q
            else None,
            "identical_prompts": sum(x["first_divergence"] == x["tokens"] for x in q),
            "logprob_mean_abs_diff": sum(x["logprob_abs_diff_sum"] for x in q) / lp_n
            if lp_n
            else None,
        }
    return {
        "model": "SmolLM2-135M-Instruct (HF transformers, CPU, 1 thread)",
        "dtype": args.dtype,
        "block_size": args.block,
        "layout": LAYOUT_CPU_PACKED,
        "prompts": len(kinds),
        "mix": {k: kinds.count(k) for k in ("chat", "code", "doc")},
        "tokens_per_prompt": args.tokens,
        "raw_bytes": stats[codecs[0]]["raw"],
        "codecs": rows,
    }


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["codecs"])
    rows = [result["codecs"][n] for n in names]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].bar(names, [r["wire_ratio"] for r in rows])
    ax[0].set_title(f"wire / raw bytes ({result['dtype']})")
    x = np.arange(len(names))
    ax[1].bar(x - 0.2, [r["encode_GBps_one_core"] for r in rows], 0.4, label="encode")
    ax[1].bar(x + 0.2, [r["decode_GBps_one_core"] for r in rows], 0.4, label="decode")
    ax[1].set_xticks(x, names)
    ax[1].set_title("GB/s of raw KV, one core")
    ax[1].legend()
    ax[2].bar(names, [r["greedy_agreement"] or 0 for r in rows])
    low = min(r["greedy_agreement"] or 0 for r in rows)
    ax[2].set_ylim(max(0.0, low - 0.05), 1.0)
    ax[2].set_title(
        f"greedy agreement with none ({result['prompts']} x {result['tokens_per_prompt']})"
    )
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "codec.png", dpi=110)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdd bench codec", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results/codec"))
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    ap.add_argument("--block", type=int, default=32, help="tokens per KV block (the configs')")
    ap.add_argument("--codecs", default="none,zstd,lz4,int8,int8+zstd,fp8,fp8+zstd")
    args = ap.parse_args(argv)
    if not args.codecs.startswith("none"):
        ap.error("--codecs must start with none (the quality reference)")
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out)
    print(json.dumps(result, indent=1))
    return 0
