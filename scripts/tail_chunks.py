"""How much do prefill tail chunks cost? (issue 20: the PDD report's bathtub valleys)

The PDD report explains dips in BCR near 20, 40 and 70% prefix hit by tail chunks: a prompt's
new tokens split into full chunks and a leftover one that runs as its own, under-filled forward.
This prints, for a chip profile and the planner's synthetic agentic workload at each hit rate
(every conversation the same size: ``jitter`` 0), P's prefill seconds per request with the
profile's small-forward costs and without them (``prefill.min_forward_tokens``, the roofline
knee: a forward of fewer tokens costs as many; ``prefill.forward_buckets``, static shapes: a
forward is padded to its bucket), and the share of the time spent in attention. P holds each
conversation's previous prompt, not the answer MD generated (as in pdd), so a turn's new tokens
are the answer and the new text.

    .venv/bin/python scripts/tail_chunks.py configs/profiles/chip-a-moe.yaml \
        --contexts 65536,16384 --out docs/results/plan/tail-chunks
    .venv/bin/python scripts/tail_chunks.py configs/profiles/chip-a-static.yaml \
        --hits "$(seq -s, 0.50 0.01 0.99)" --out docs/results/plan/tail-chunks-static
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd.plan.profile import ChipProfile, load_profile  # noqa: E402
from pdd.plan.workload import AgenticWorkload, agentic  # noqa: E402


def per_request(prof: ChipProfile, context: int, hit: float) -> dict[str, float]:
    """Mean prefill seconds per request on P, with the small-forward costs and without them,
    and attention's share."""
    unpadded = {"min_forward_tokens": 0, "forward_buckets": []}
    flat = prof.model_copy(update={"prefill": prof.prefill.model_copy(update=unpadded)})
    work = agentic(AgenticWorkload(requests=400, context_tokens=context, hit_rate=hit, jitter=0.0))
    padded = linear = attention = 0.0
    n = 0
    for conv in work.conversations:
        held = 0
        for turn in conv.turns:
            new = turn.prompt_tokens - held
            padded += prof.prefill_s(new, held)
            linear += flat.prefill_s(new, held)
            attention += prof.prefill.attention_s(new, held)
            held, n = turn.prompt_tokens, n + 1
    return {"context_tokens": context, "hit_rate": hit, "seconds": padded / n,
            "seconds_unpadded": linear / n, "tail_cost": padded / linear - 1,
            "attention_share": attention / padded}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--contexts", default="65536", help="mean prompt lengths, comma-separated")
    ap.add_argument("--hits", default=",".join(f"{h / 100:g}" for h in range(5, 100, 5)))
    ap.add_argument("--out", type=Path, default=None, help="write tail_chunks.json/.md here")
    args = ap.parse_args()
    prof = load_profile(args.profile)
    rows = [per_request(prof, int(c), float(h))
            for c in args.contexts.split(",") for h in args.hits.split(",")]  # fmt: skip
    lines = [f"{prof.name} ({prof.model}): chunk {prof.prefill.chunk_tokens} tokens, knee "
             f"{prof.prefill.min_forward_tokens} tokens, buckets "
             f"{prof.prefill.forward_buckets or 'none'}", "",
             "| context | hit rate | P prefill s/request | unpadded | tail chunks add "
             "| attention share |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['context_tokens']} | {r['hit_rate']:.2f} | {r['seconds']:.3f} | "
                     f"{r['seconds_unpadded']:.3f} | {r['tail_cost']:+.1%} | "
                     f"{r['attention_share']:.0%} |")  # fmt: skip
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        inputs = {"profile": str(args.profile), "contexts": args.contexts, "hits": args.hits}
        (args.out / "tail_chunks.json").write_text(
            json.dumps({"inputs": inputs, "rows": rows}, indent=2) + "\n"
        )
        (args.out / "tail_chunks.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
