"""Check pdd's model of vLLM's CPU KV block interior against real engines.

Exports the same 130-token prompt (its first 128 tokens: whole blocks) from an engine at block
size 32 and from one at block size 128, through pdd's connector, then regroups the four 32-token
blocks with ``pdd.worker.kv_convert.Regroup`` (which assumes the layout ``cpu_packed_kv``: per
KV head K transposed [D, B], then V [B, D]) and compares the result with the real 128-token
block, byte for byte. Also prints the layout each engine reports (``cpu_amx``: vLLM's AMX
kernels, whose interior pdd does not convert).

    .venv/bin/python scripts/cpu_kv_layout.py float32     # ~1 minute here
    .venv/bin/python scripts/cpu_kv_layout.py bfloat16    # on a CPU without AMX tiles
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd.cache.arena import FenceBoard, SlotArena  # noqa: E402
from pdd.config import EngineConfig, ModelConfig  # noqa: E402
from pdd.engine.connector_params import ConnectorSettings, ExportParams, FenceRef, wrap  # noqa: E402
from pdd.engine.engine import Engine  # noqa: E402
from pdd.engine.types import KvConnectorSpec, SamplingSpec  # noqa: E402
from pdd.errors import ConfigError  # noqa: E402
from pdd.kv_geometry import folder_geometry  # noqa: E402
from pdd.worker.kv_convert import Regroup  # noqa: E402

TOKENS = 128


async def export(dtype: str, block: int, prompt: list[int]):
    """(geometry, the prompt's whole blocks as bytes) of one engine at ``block``."""
    folder = ModelConfig().resolved_path()
    shape = folder_geometry(folder, block, dtype)  # only its block size in bytes is used here
    n = TOKENS // block
    arena = SlotArena.create(n, shape.block_bytes, f"pdd-layout-{block}")
    fences = FenceBoard.create(4, f"pdd-layout-fence-{block}")
    settings = ConnectorSettings(arena=arena.ref, fences=fences.ref)
    spec = KvConnectorSpec(role="kv_producer", extra_config=settings.model_dump())
    cfg = EngineConfig(dtype=dtype, max_model_len=1024, kv_cache_space_gib=0.25, block_size=block)
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


async def main(dtype: str) -> int:
    rng = random.Random(3)
    prompt = [rng.randrange(200, 40000) for _ in range(TOKENS + 2)]
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
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "float32")))
