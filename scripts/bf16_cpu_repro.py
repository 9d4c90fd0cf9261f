"""Minimal reproduction: the default model's greedy chat answer in bfloat16 on a CPU with AMX.

    .venv/bin/python scripts/bf16_cpu_repro.py [bfloat16|float32] [--attn-isa vec]

Plain vLLM 0.32 (the offline ``LLM`` class, no pdd code), the prepared default model folder
(``pdd model prepare --set model.dtype=...``), its chat template, greedy decoding. Prints the
answer to "What is the capital of France?" and the first token's top-3 logprobs, so the margin
between the top two first tokens is visible. ``--attn-isa vec`` swaps vLLM's AMX attention
kernel for its AVX-512 one (a private vLLM function, patched in this process only: the offline
engine runs in-process with VLLM_ENABLE_V1_MULTIPROCESSING=0). Findings: docs/notes/engine.md
"bfloat16 on CPU".
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dtype", nargs="?", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attn-isa", choices=["auto", "vec"], default="auto")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    if args.attn_isa == "vec":
        import vllm.v1.attention.backends.cpu_attn as cpu_attn

        chosen = cpu_attn._get_attn_isa
        cpu_attn._get_attn_isa = lambda *a, **k: (
            "vec" if chosen(*a, **k) == "amx" else chosen(*a, **k)
        )

    from pdd.config import ModelConfig

    folder = str(ModelConfig(dtype=args.dtype).resolved_path())
    llm = LLM(folder, dtype=args.dtype, max_model_len=1024, block_size=32, enforce_eager=True)
    tok = llm.get_tokenizer()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, logprobs=3))[0]
    first = out.outputs[0].logprobs[0]
    print("answer:", repr(out.outputs[0].text))
    print("first token:", {tok.decode([t]): round(lp.logprob, 3) for t, lp in first.items()})


if __name__ == "__main__":
    main()
