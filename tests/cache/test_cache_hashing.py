"""Block hash chains: stable across processes, whole blocks only, models never alias, cheap."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest

from pdd.cache.hashing import block_hashes, model_salt
from pdd.errors import InvalidRequestError

SALT = model_salt("SmolLM2-135M-Instruct", "bfloat16", 32)
# Pinned values: a change here means every deployed cache and router disagree on names.
GOLDEN = ["b99e1dedf7ae16a31a55ec470a9a9da6", "ef0be20c05bd95c17878e7404b13a018"]


def test_golden_values_are_stable():
    assert [h.hex() for h in block_hashes(list(range(70)), 32, SALT)] == GOLDEN


def test_same_names_in_another_process_with_another_hash_seed():
    code = (
        "from pdd.cache.hashing import block_hashes, model_salt;"
        "s = model_salt('SmolLM2-135M-Instruct', 'bfloat16', 32);"
        "print(','.join(h.hex() for h in block_hashes(list(range(70)), 32, s)))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(",") == GOLDEN


def test_whole_blocks_only_and_prefixes_share_names():
    tokens = list(range(100))
    full = block_hashes(tokens, 32, SALT)
    assert len(full) == 3  # 4 tokens of a partial block are not hashed
    assert block_hashes(tokens[:64], 32, SALT) == full[:2]
    assert block_hashes(tokens[:31], 32, SALT) == []
    changed = block_hashes(tokens[:40] + [7] + tokens[41:], 32, SALT)
    assert changed[0] == full[0] and changed[1:] != full[1:]  # block 1 and all after it


def test_a_chain_continues_from_a_parent():
    tokens = list(range(128))
    full = block_hashes(tokens, 32, SALT)
    assert block_hashes(tokens[64:], 32, SALT, parent=full[1]) == full[2:]


def test_models_dtypes_and_block_sizes_never_alias():
    tokens = list(range(64))
    names = {
        block_hashes(tokens, 32, SALT)[0],
        block_hashes(tokens, 32, model_salt("SmolLM2-135M-Instruct", "float32", 32))[0],
        block_hashes(tokens, 32, model_salt("other-model", "bfloat16", 32))[0],
        block_hashes(tokens, 32)[0],
        block_hashes(tokens, 16)[1],  # the same 32 tokens as a 16-token chain
    }
    assert len(names) == 5
    assert all(len(h) == 16 for h in names)


def test_out_of_range_tokens_are_rejected():
    with pytest.raises(InvalidRequestError):
        block_hashes([-1] * 32, 32)
    with pytest.raises(InvalidRequestError):
        block_hashes([2**32] * 32, 32)


def test_hashing_a_6k_token_prompt_is_cheap():
    tokens = [(i * 7919) % 49152 for i in range(6144)]
    times = []
    for _ in range(20):
        start = time.perf_counter()
        hashes = block_hashes(tokens, 32, SALT)
        times.append(time.perf_counter() - start)
    per_block_us = statistics.median(times) / len(hashes) * 1e6
    print(f"6144 tokens: {statistics.median(times) * 1e3:.3f} ms, {per_block_us:.2f} us/block")
    assert len(hashes) == 192
    assert per_block_us < 20  # ~1 us/block measured; generous for 2 shared cores


def test_router_side_modules_load_no_torch_vllm_or_numpy():
    code = (
        "import sys, pdd.cache.hashing, pdd.cache.messages, pdd.cache.view;"
        "print(sorted(m for m in ('torch', 'vllm', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
