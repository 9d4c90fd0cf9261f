"""Process environment vLLM needs, set before vLLM (or huggingface_hub) is imported.

Owns the few environment variables pdd sets on the operator's behalf. Everything else comes
from typed config (pdd.config); these exist only because vLLM and huggingface_hub read them at
import or spawn time.
"""

from __future__ import annotations

import os

# setdefault semantics: an operator's explicit value always wins.
PROCESS_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",  # no model hub is reachable; never try
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_HOST_IP": "127.0.0.1",  # single-node engines; avoids probing interfaces
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "TOKENIZERS_PARALLELISM": "false",  # the engine core is spawned after tokenizers ran
}


def configure_process_env() -> None:
    """Set pdd's defaults for vLLM's environment variables (idempotent)."""
    for key, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(key, value)
