"""Check pdd's model of vLLM's CPU KV block interior against real engines.

Exports the same 130-token prompt (its first 128 tokens: whole blocks) from an engine at block
size 32 and from one at block size 128, through pdd's connector, then regroups the four 32-token
blocks with ``pdd.worker.kv_convert.Regroup`` (which assumes the layout ``cpu_packed_kv``: per
KV head K transposed [D, B], then V [B, D]) and compares the result with the real 128-token
block, byte for byte. Also prints the layout each engine reports (``cpu_amx``: vLLM's AMX
kernels, whose interior pdd does not convert).

    .venv/bin/python scripts/cpu_kv_layout.py float32     # ~1 minute here
    .venv/bin/python scripts/cpu_kv_layout.py bfloat16    # on a CPU without AMX tiles: and
                                                          # widened against float32's blocks
    .venv/bin/python scripts/cpu_kv_layout.py fp8_e4m3    # vLLM's fp8 KV cache (see below)

With an fp8 KV-cache dtype it checks what an MD of that cache does to P's float32 KV instead:
the same prompt exported at block 32 from a float32 engine and from one with that fp8 cache
(float32 weights); the float32 blocks narrowed by ``kv_convert.convert_block`` against the fp8
engine's own, layer by layer (layer 0's K and V come from the embeddings alone, so they must
match byte for byte: pdd truncates toward zero as vLLM's CPU kernels do; later layers follow
attention over the cache's own precision).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd.cache.arena import FenceBoard, SlotArena  # noqa: E402
from pdd.config import EngineConfig, ModelConfig  # noqa: E402
from pdd.engine.connector_params import ConnectorSettings, ExportParams, FenceRef, wrap  # noqa: E402
from pdd.engine.engine import Engine  # noqa: E402
from pdd.engine.types import KvConnectorSpec, SamplingSpec  # noqa: E402
from pdd.errors import ConfigError  # noqa: E402
from pdd.kv_geometry import folder_geometry  # noqa: E402
from pdd.worker.kv_convert import FP8, Regroup, convert_block  # noqa: E402

TOKENS = 128


async def export(dtype: str, block: int, prompt: list[int], kv_cache_dtype: str = "auto"):
    """(geometry, the prompt's whole blocks as bytes) of one engine at ``block``."""
    folder = ModelConfig().resolved_path()
    cfg = EngineConfig(dtype=dtype, max_model_len=1024, kv_cache_space_gib=0.25, block_size=block,
                       kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    # only its block size in bytes is used here
    shape = folder_geometry(folder, block, cfg.kv_dtype(dtype))
    n = TOKENS // block
    arena = SlotArena.create(n, shape.block_bytes, f"pdd-layout-{block}")
    fences = FenceBoard.create(4, f"pdd-layout-fence-{block}")
    settings = ConnectorSettings(arena=arena.ref, fences=fences.ref)
    spec = KvConnectorSpec(role="kv_producer", extra_config=settings.model_dump())
    engine = Engine(ModelConfig(), cfg, spec)
    try:
        await engine.start()
        params = wrap(export=ExportParams(slots=list(range(n)), fence=FenceRef(index=0, ticket=1)))
        sampling = SamplingSpec(temperature=0.0, max_tokens=1)
        async for _ in engine.generate("layout", prompt, sampling, kv_transfer_params=params):
            pass
        end = time.monotonic() + 30
        while fences.read(0) != 1:
            if time.monotonic() > end:
                raise SystemExit("the export's fence was never posted")
            await asyncio.sleep(0.01)
        return engine.kv_geometry, [bytes(arena.view(i)) for i in range(n)]
    finally:
        await engine.stop()
        for owned in (arena, fences):
            owned.close()
            owned.unlink()


def by_layer(blocks: list[bytes], src, dst, dtype) -> np.ndarray:
    """``blocks`` of geometry ``src`` converted by pdd into ``dst`` (as they are when the two
    are one), as [layer, every value of that layer over the blocks] of ``dtype``."""
    out = []
    for block in blocks:
        if src != dst:
            converted = bytearray(dst.block_bytes)
            convert_block(block, src, converted, dst)
            block = bytes(converted)
        out.append(np.frombuffer(block, dtype).reshape(dst.num_layers, -1))
    return np.concatenate(out, axis=1)


async def narrowed(fp8: str, prompt: list[int]) -> int:
    """float32 blocks narrowed by pdd against an fp8 cache's own, per layer."""
    wide_geometry, wide = await export("float32", 32, prompt)
    fp8_geometry, own = await export("float32", 32, prompt, fp8)
    print(f"fp8 cache: layout {fp8_geometry.layout}, kv_dtype {fp8_geometry.kv_dtype}")
    layers = fp8_geometry.num_layers
    mine = by_layer(wide, wide_geometry, fp8_geometry, np.uint8)
    theirs = by_layer(own, fp8_geometry, fp8_geometry, np.uint8)
    share = [float(x) for x in (mine == theirs).mean(axis=1)]
    print(f"{fp8}: layer 0 bytes equal {share[0]:.6f}; layers 1-{layers - 1}: "
          f"min {min(share[1:]):.4f}, mean {sum(share[1:]) / (layers - 1):.4f}")  # fmt: skip
    return 0 if share[0] == 1.0 else 1


async def main(dtype: str) -> int:
    rng = random.Random(3)
    prompt = [rng.randrange(200, 40000) for _ in range(TOKENS + 2)]
    if dtype in FP8:
        return await narrowed(dtype, prompt)
    small_geometry, small = await export(dtype, 32, prompt)
    big_geometry, big = await export(dtype, 128, prompt)
    print(f"layout at block 32: {small_geometry.layout}; at block 128: {big_geometry.layout}")
    try:
        regroup = Regroup(small_geometry, big_geometry)
    except ConfigError as exc:  # e.g. cpu_amx: an interior pdd does not convert
        print(f"{dtype}: not converted ({exc.message})")
        return 2
    got = None
    for i, block in enumerate(small):
        got = regroup.put(i, block, [0]).get(0, got)
    equal = got == big[0]
    print(f"{dtype}: four 32-token blocks regrouped == the 128-token block: {equal}")
    if dtype == "bfloat16" and equal:
        return await widened(small_geometry, small, prompt)
    return 0 if equal else 1


async def widened(geometry, blocks: list[bytes], prompt: list[int]) -> int:
    """One interior for both dtypes: the bfloat16 blocks widened by pdd against a float32
    engine's own, per layer (they differ by the weights' and the cache's rounding only, so
    the correlation is ~1; another interior, as AMX's, gives ~0)."""
    wide_geometry, wide = await export("float32", 32, prompt)
    a = by_layer(blocks, geometry, wide_geometry, np.float32)
    b = by_layer(wide, wide_geometry, wide_geometry, np.float32)
    corr = [float(np.corrcoef(x, y)[0, 1]) for x, y in zip(a, b, strict=True)]
    rel = [float(np.abs(x - y).mean() / np.abs(y).mean()) for x, y in zip(a, b, strict=True)]
    print(f"bfloat16 widened vs float32, per layer: correlation min {min(corr):.5f} (layer 0 "
          f"{corr[0]:.5f}); mean |difference| / mean |value| max {max(rel):.4f} (layer 0 "
          f"{rel[0]:.4f})")  # fmt: skip
    return 0 if min(corr) > 0.99 else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "float32")))
