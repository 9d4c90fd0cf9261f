"""The size of one KV block, known before the engine starts (the arena is made first).

The shell creates the slot arena before vLLM exists (the connector maps it by name at engine
start), so the slot size comes from the model folder's config.json, with vLLM's CPU layout
(pdd.cache.host_tier.kv_block_bytes). The connector checks it against the real paged cache
at engine start and refuses a mismatch (ConfigError), so an error here cannot go unnoticed.
"""

from __future__ import annotations

import json

from pdd.cache.host_tier import kv_block_bytes
from pdd.config import ModelConfig
from pdd.errors import ModelError
from pdd.kv_geometry import DTYPE_BYTES


def block_bytes_of(model: ModelConfig, block_size: int, dtype: str | None = None) -> int:
    """Bytes of one KV block (K and V, every layer) in KV dtype ``dtype`` (None: the model's).
    Prepares the model folder if needed."""
    layers, kv_heads, _, packed = block_shape_of(model, block_size)
    itemsize = DTYPE_BYTES[dtype or model.dtype]
    return kv_block_bytes(layers, kv_heads, packed // 2, block_size, itemsize)


def block_shape_of(model: ModelConfig, block_size: int) -> tuple[int, int, int, int]:
    """One slot's logical shape: (layers, kv_heads, block_size, 2 * head_dim) of model.dtype,
    K and V packed in the last dim (vLLM's CPU layout). What a KV codec needs to know."""
    from pdd.engine.model import prepare_model  # cheap: no vLLM

    path = prepare_model(model) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    kv_heads = hf.get("num_key_value_heads") or heads
    return hf["num_hidden_layers"], kv_heads, block_size, 2 * head_dim
