"""The oracle: a direct vLLM run (no pdd code on the generation path), greedy.

Usage: python vllm_oracle.py MODEL_DIR DTYPE MAX_TOKENS [ENGINE_JSON] < prompts.json > results.json
ENGINE_JSON: more of vLLM's engine arguments, e.g. {"kv_cache_dtype": "fp8_e4m3"} or
{"dtype": "bfloat16"} (instead of DTYPE: MODEL_DIR's weights cast, as pdd's engine.dtype), or
{"tensor_parallel_size": 3, "omp_threads_bind": "0|1|1"} (vLLM's multiprocess executor, a
process per rank, each on its entry of VLLM_CPU_OMP_THREADS_BIND)
prompts.json is a list of prompts: strings, lists of token ids, or {"prompt_token_ids": [...]}
with any of "json_schema": {...} (a greedy run under vLLM's own structured outputs, xgrammar
backend), "sampling": {"frequency_penalty": ...} (more vLLM SamplingParams; logit_bias keys as
strings, as in JSON) and "max_tokens": N
(instead of MAX_TOKENS);
the last stdout line is ORACLE_JSON: followed by
[{"prompt_token_ids": [...], "token_ids": [...], "text": "..."}] in the same order, with
"prompt_logprobs": [logprob of each prompt token after the first] and "logprobs": [logprob of
each generated token] where "sampling" asked for them.
"""

import json
import os
import sys


def main() -> None:
    model, dtype, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    engine = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    dtype = engine.pop("dtype", dtype)  # weights cast from MODEL_DIR's, as pdd's engine.dtype
    if "omp_threads_bind" in engine:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine.pop("omp_threads_bind")
    if engine.get("tensor_parallel_size", 1) > 1:
        engine["distributed_executor_backend"] = "mp"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts = json.load(sys.stdin)
    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=4096,
        block_size=32,
        enforce_eager=True,
        **engine,
        structured_outputs_config={"backend": "xgrammar"},
    )

    def params(p: dict) -> SamplingParams:
        extra = dict(p.get("sampling", {}))
        if "logit_bias" in extra:  # JSON object keys are strings; vLLM takes token ids
            extra["logit_bias"] = {int(t): b for t, b in extra["logit_bias"].items()}
        if "json_schema" in p:
            extra["structured_outputs"] = StructuredOutputsParams(json=p["json_schema"])
        return SamplingParams(temperature=0.0, max_tokens=p.get("max_tokens", max_tokens), **extra)

    # One prompt at a time, as the test sends them: batch composition changes bf16 numerics.
    runs = []
    for p in prompts:
        if isinstance(p, dict):
            runs.append(({"prompt_token_ids": p["prompt_token_ids"]}, params(p)))
        else:
            runs.append(({"prompt_token_ids": p} if isinstance(p, list) else p, params({})))
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in runs]

    def result(o) -> dict:
        out = o.outputs[0]
        r = {"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(out.token_ids),
             "text": out.text}  # fmt: skip
        if o.prompt_logprobs is not None:
            pairs = zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)
            r["prompt_logprobs"] = [pos[t].logprob for t, pos in pairs]
        if out.logprobs is not None:
            pairs = zip(out.token_ids, out.logprobs, strict=True)
            r["logprobs"] = [pos[t].logprob for t, pos in pairs]
        return r

    sys.stdout.write("\nORACLE_JSON:")
    json.dump([result(o) for o in outs], sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
