"""Greedy-token agreement of heterogeneous PDD with a colocated run of MD's configuration.

Starts `pdd serve --config configs/hetero.yaml` (P and RLD in one dtype, MD in another) and runs
the 20 prompts of the exactness suite (tests/e2e/test_pdd_local.py) through p_md and p_rld_md
One-Shot and Catch-Up; the reference is a direct vLLM run in MD's dtype (tests/e2e/
vllm_oracle.py). Per variant: prompts whose 16 greedy tokens equal the reference, and the first
divergent token position of the others. Also the DRC's view: MD's refused chunks (must be 0).

    .venv/bin/python scripts/hetero_agreement.py --direction bf16-p --out /tmp/hetero-bf16p.json
    .venv/bin/python scripts/hetero_agreement.py --direction bf16-md --out /tmp/hetero-bf16md.json

``bf16-p``: P and RLD bfloat16, MD float32 (configs/hetero.yaml as written); ``bf16-md``: the
reverse (P and RLD float32, MD bfloat16). Takes ~6 minutes here (4 engines, one at a time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd.config import ModelConfig, load_config  # noqa: E402
from pdd.router.text.tokenizer import TextCodec  # noqa: E402
from tests.e2e.test_pdd_local import VARIANTS, build_prompts  # noqa: E402
from tests.helpers import run_oracle, serve, stop  # noqa: E402

CONFIG = "configs/hetero.yaml"
WORKERS = ["p", "rld", "md"]
MAX_TOKENS = 16
DIRECTIONS = {  # (P and RLD dtype, MD dtype)
    "bf16-p": ("bfloat16", "float32"),
    "bf16-md": ("float32", "bfloat16"),
}


def divergence(codec: TextCodec, want: list[int], got: str) -> int | None:
    """The first token position where ``got`` leaves the reference's text (None: equal)."""
    if got == codec.decode(want):
        return None
    for k in range(len(want)):
        if not got.startswith(codec.decode(want[: k + 1])):
            return k
    return len(want)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--direction", choices=sorted(DIRECTIONS), default="bf16-p")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sender, md = DIRECTIONS[args.direction]
    codec = TextCodec.from_folder(ModelConfig().resolved_path())
    prompts = build_prompts(codec)
    reference = run_oracle(prompts, md, MAX_TOKENS)
    sets = [f"workers.{i}.engine.dtype={d}" for i, d in enumerate((sender, sender, md))]
    served = serve(CONFIG, WORKERS, sets)
    name = load_config(CONFIG).model.name
    rows: dict[str, list] = {}
    try:
        for variant, pdd in VARIANTS.items():
            rows[variant] = []
            for prompt, ref in zip(prompts, reference, strict=True):
                body = {"model": name, "prompt": prompt, "temperature": 0,
                        "max_tokens": MAX_TOKENS, "pdd": pdd}  # fmt: skip
                r = httpx.post(f"{served.url}/completions", json=body, timeout=300)
                r.raise_for_status()
                out = r.json()
                pos = divergence(codec, ref["token_ids"], out["choices"][0]["text"])
                rows[variant].append({"prompt_tokens": len(prompt), "diverges_at": pos,
                                      "pipeline": out["pdd"]["pipeline"]})  # fmt: skip
        debug = httpx.get(served.url.removesuffix("/v1") + "/debug/workers", timeout=10).json()
    finally:
        stop(served)
    summary = {
        "direction": {"p_rld": sender, "md": md},
        "reference": f"direct vLLM, {md}",
        "variants": {
            v: {"equal": sum(x["diverges_at"] is None for x in xs), "prompts": len(xs),
                "first_divergence": sorted(x["diverges_at"] for x in xs
                                           if x["diverges_at"] is not None)}  # fmt: skip
            for v, xs in rows.items()
        },
        "workers": {w["id"]: w.get("geometry", {}).get("kv_dtype") for w in debug["workers"]},
        "rows": rows,
    }
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("direction", "variants", "workers")}, indent=1))


if __name__ == "__main__":
    main()
