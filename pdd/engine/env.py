"""Process environment vLLM needs, set before vLLM (or huggingface_hub) is imported.

Owns the few environment variables pdd sets on the operator's behalf. Everything else comes
from typed config (pdd.config); these exist only because vLLM and huggingface_hub read them at
import or spawn time.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from pdd.errors import ConfigError

# setdefault semantics: an operator's explicit value always wins.
PROCESS_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",  # no model hub is reachable; never try
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_HOST_IP": "127.0.0.1",  # single-node engines; avoids probing interfaces
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "TOKENIZERS_PARALLELISM": "false",  # the engine core is spawned after tokenizers ran
    # stdout carries one machine-read line per process ("pdd worker ready: ..."); logs go to
    # stderr.
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    # oneDNN's process-wide cache of compiled kernels keeps one per prefill length it saw:
    # ~1 GiB on a prefill engine. vLLM caches its matmuls itself (pdd.engine.heap).
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
}


def configure_process_env() -> None:
    """Set pdd's defaults for vLLM's environment variables (idempotent)."""
    for key, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(key, value)


def omp_env(bind: str, multiproc: bool) -> dict[str, str | None]:
    """OpenMP placement for the engine core. "auto"/"nobind": the OpenMP runtime decides.

    vLLM binds threads (VLLM_CPU_OMP_THREADS_BIND) only in its multiprocess executor; with the
    in-process executor an explicit CPU list ("0", "2-3", "0,2") becomes OMP_PLACES here.
    """
    if multiproc:
        return {"VLLM_CPU_OMP_THREADS_BIND": bind}
    if bind in ("auto", "nobind"):
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cpus: list[int] = []
    try:
        for part in bind.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigError(f"engine.omp_threads_bind: bad CPU list {bind!r}") from None
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(len(cpus)),
        "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}",
        "OMP_PROC_BIND": "true",
    }


def update_env(values: dict[str, str | None], env: MutableMapping[str, str] = os.environ) -> None:
    """Set each key of ``values`` in ``env`` (this process's environment by default); a None
    value removes the key."""
    for key, value in values.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
