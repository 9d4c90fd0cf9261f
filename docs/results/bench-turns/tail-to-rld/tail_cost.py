"""What P's tail saves RLD, on one engine alone: the first step after a load of 2,976 tokens
(93 blocks of 32; the prompt's last 24 tokens and P's token computed) against one after a
load of 3,008 (the tail there too: P's token alone), float32, one core, vLLM's own prefix
cache standing in for the load. Four prompts; ms per step, as a request of max_tokens 1.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python docs/results/bench-turns/tail-to-rld/tail_cost.py
"""

import os
import random
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    from vllm import LLM, SamplingParams

    from pdd.config import ModelConfig
    from pdd.engine.model import prepare_model

    folder = prepare_model(ModelConfig(dtype="float32"))  # the default model's float32 folder
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True,
              block_size=32, max_model_len=4096, enable_prefix_caching=True,
              max_num_batched_tokens=4096)  # fmt: skip
    one = SamplingParams(max_tokens=1, temperature=0)

    def ms(prompt: list[int]) -> int:
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        return round((time.perf_counter() - started) * 1000)

    tail, alone = [], []
    for seed in range(4):
        rng = random.Random(seed)
        prompt = [rng.randrange(1000, 40000) for _ in range(3008)]
        ms(prompt)  # the cache holds its 94 blocks
        tail.append(ms(prompt[:3000] + [7]))  # 2,976 cached: 24 prompt tokens + P's token
        alone.append(ms(prompt + [7]))  # 3,008 cached: P's token alone
    print({"tail_and_token_ms": tail, "token_alone_ms": alone})


if __name__ == "__main__":
    main()
