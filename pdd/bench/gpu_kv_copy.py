"""GB/s of TorchBlockCopier's save (device -> arena) and load (arena -> device) on CUDA.

    pdd bench gpu-kv-copy --out results/gpu_kv_copy [--reps 10]
    pdd bench gpu-kv-copy --smoke --out /tmp/x   # tiny, any device

KV layouts like an 8B model (32 layers, 8 KV heads, head_dim 128, block_size 16, bf16: 2 MiB
per block) and like SmolLM2-135M (30 layers, 3 KV heads, head_dim 64: 360 KiB per block), in
vLLM's block-first layouts (FlashAttention 0.32 [N, H, B, 2D], FlashInfer [N, 2, B, H, D]) and
the K/V-split one ([2, N, B, H, D]); copies of 1, 16 and 256 blocks at random block ids, to
random ("random") or consecutive ("run") slots of a real SlotArena, with the arena registered
(cudaHostRegister) or through a pinned staging buffer. Baselines in the same run, same bytes:
a plain ``.cpu()`` of a contiguous device tensor (allocates fresh pageable memory), a copy
into an existing pageable buffer, into a pinned buffer and into the registered arena (raw
DMA), and the H2D counterparts. Also the registered save/load of 256 blocks with 16 and 256 MiB
of staging instead of the default 64 MiB, and a tensor-parallel rank's copier (rank 0 of TP 2:
half the KV heads, into and out of the model's whole slots through pinned staging; its bytes
are the rank's). Each number is the
median of --reps timed calls after 2 warm-ups; a call includes its final synchronize. Also
checks one 256-block save + load round trip per layout bit for bit. Writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from pdd.cache.arena import SlotArena
from pdd.engine.kv_copy import HeadShard, PagedLayers, TorchBlockCopier

MODELS = {  # name -> (layers, kv heads, head dim, block size)
    "8b": (32, 8, 128, 16),
    "smollm2-135m": (30, 3, 64, 16),
}
SMOKE_MODELS = {"tiny": (4, 2, 8, 4)}
LAYOUTS = {  # name -> logical shape of one layer, from (N, H, B, D)
    "flash-attn": lambda n, h, b, d: (n, h, b, 2 * d),
    "flashinfer": lambda n, h, b, d: (n, 2, b, h, d),
    "kv-split": lambda n, h, b, d: (2, n, b, h, d),
}
COUNTS = (1, 16, 256)
NUM_BLOCKS = 1024  # blocks per layer in the paged cache (8b: 2 GiB)
SLOTS = 512


def timed(fn, reps: int) -> float:
    """Median seconds of fn() (which must synchronize) after 2 warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_cache(
    model: str, layout: str, dtype, device, heads: int | None = None
) -> dict[str, torch.Tensor]:
    layers, h, d, b = (SMOKE_MODELS | MODELS)[model]
    shape = LAYOUTS[layout](NUM_BLOCKS, heads or h, b, d)
    g = torch.Generator(device=device).manual_seed(0)
    return {
        f"layers.{i}": torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
        for i in range(layers)
    }


def bench_copier(copier, n: int, order: str, reps: int) -> dict:
    rng = random.Random(n)
    ids = tuple(rng.sample(range(1, NUM_BLOCKS), n))
    slots = tuple(range(n)) if order == "run" else tuple(rng.sample(range(SLOTS), n))
    save = timed(lambda: copier.save(ids, slots), reps)
    load = timed(lambda: copier.load(slots, ids), reps)
    return {"save_s": save, "load_s": load}


def check_roundtrip(copier: TorchBlockCopier, caches: dict, block_dim: int) -> bool:
    """Save 256 blocks, load them back at 256 other ids of the same cache: bit-identical?"""
    ids = random.Random(1).sample(range(1, NUM_BLOCKS), 512)
    src, dst, slots = tuple(ids[:256]), tuple(ids[256:]), tuple(range(256, 512))
    copier.save(src, slots)
    copier.load(slots, dst)
    ok = True
    for t in caches.values():
        a = t.index_select(block_dim, torch.tensor(src, device=t.device))
        b = t.index_select(block_dim, torch.tensor(dst, device=t.device))
        ok = ok and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return ok


def baselines(nbytes: int, arena: SlotArena, device, reps: int) -> dict:
    """Raw copies of nbytes: pageable .cpu(), pinned, registered arena; and H2D."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {"d2h_cpu_s": timed(lambda: x.cpu(), reps)}
    if device.type != "cuda":
        return out
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    out["d2h_pageable_s"] = timed(lambda: (pageable.copy_(x), sync(device)), reps)
    out["d2h_pinned_s"] = timed(lambda: (pinned.copy_(x, non_blocking=True), sync(device)), reps)
    out["h2d_pageable_s"] = timed(lambda: (x.copy_(pageable), sync(device)), reps)
    out["h2d_pinned_s"] = timed(lambda: (x.copy_(pinned, non_blocking=True), sync(device)), reps)
    view = torch.frombuffer(arena.buffer, dtype=torch.uint8)[:nbytes]
    rc = torch.cuda.cudart().cudaHostRegister(view.data_ptr(), nbytes, 0)
    if int(rc) == 0:
        out["d2h_registered_s"] = timed(
            lambda: (view.copy_(x, non_blocking=True), sync(device)), reps
        )
        out["h2d_registered_s"] = timed(
            lambda: (x.copy_(view, non_blocking=True), sync(device)), reps
        )
        torch.cuda.cudart().cudaHostUnregister(view.data_ptr())
    return out


def chunk_sizes(model: str, layers: PagedLayers, arena: SlotArena, reps: int) -> list[dict]:
    """256 random blocks, registered arena, at other staging sizes than the default 64 MiB."""
    rows = []
    for mib in (16, 256):
        copier = TorchBlockCopier(layers, arena, host="register", chunk_bytes=mib << 20)
        r = bench_copier(copier, 256, "random", reps)
        copier.close()
        rows.append({"model": model, "layout": "flash-attn", "host": f"register/{mib}MiB",
                     "slots": "random", "blocks": 256, "bytes": 256 * layers.block_bytes,
                     "setup_s": None, "roundtrip_ok": None, **r})  # fmt: skip
    return rows


def rank_rows(model: str, layout: str, arena: SlotArena, device, reps: int) -> list[dict]:
    """Rank 0 of TP 2: a cache of half the model's KV heads, copied into and out of its heads
    of the whole slots. No rows for a model with an odd number of KV heads."""
    heads = (SMOKE_MODELS | MODELS)[model][1]
    if heads % 2:
        return []
    caches = make_cache(model, layout, torch.bfloat16, device, heads=heads // 2)
    layers = PagedLayers.from_caches(caches, NUM_BLOCKS)
    t0 = time.perf_counter()
    copier = TorchBlockCopier(layers, arena, shard=HeadShard.of_rank(0, 2, heads))
    setup = time.perf_counter() - t0
    ok = check_roundtrip(copier, caches, layers.block_dim)
    rows = []
    for n in COUNTS:
        r = bench_copier(copier, n, "random", reps)
        rows.append({"model": model, "layout": layout, "host": f"{copier.host}/tp2-rank",
                     "slots": "random", "blocks": n, "bytes": n * layers.block_bytes,
                     "setup_s": setup, "roundtrip_ok": ok, **r})  # fmt: skip
    copier.close()
    return rows


def run_model(model: str, device, reps: int) -> tuple[list[dict], list[dict]]:
    rows, base = [], []
    for layout in LAYOUTS:
        caches = make_cache(model, layout, torch.bfloat16, device)
        layers = PagedLayers.from_caches(caches, NUM_BLOCKS)
        with SlotArena.create(SLOTS, layers.block_bytes, "pddbench") as arena:
            for host in ("register", "staging") if device.type == "cuda" else ("auto",):
                t0 = time.perf_counter()
                copier = TorchBlockCopier(layers, arena, host=host)
                setup = time.perf_counter() - t0
                ok = check_roundtrip(copier, caches, layers.block_dim)
                for n in COUNTS:
                    for order in ("random", "run"):
                        r = bench_copier(copier, n, order, reps)
                        rows.append({"model": model, "layout": layout, "host": copier.host,
                                     "slots": order, "blocks": n, "bytes": n * layers.block_bytes,
                                     "setup_s": setup, "roundtrip_ok": ok, **r})  # fmt: skip
                copier.close()
            rows += rank_rows(model, layout, arena, device, reps)
            if layout == "flash-attn" and device.type == "cuda":
                rows += chunk_sizes(model, layers, arena, reps)
            if layout == "flash-attn":
                for n in COUNTS:
                    nbytes = n * layers.block_bytes
                    base.append({"model": model, "blocks": n, "bytes": nbytes,
                                 **baselines(nbytes, arena, device, reps)})  # fmt: skip
        del caches, layers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, base


def gbps(nbytes: int, seconds: float | None) -> str:
    return f"{nbytes / seconds / 1e9:7.2f}" if seconds else "    n/a"


def report(rows: list[dict], base: list[dict]) -> None:
    print("model        layout     host           slots  blocks  MiB     save GB/s  load GB/s  ok")
    for r in rows:
        print(f"{r['model']:<12} {r['layout']:<10} {r['host']:<14} {r['slots']:<6} "
              f"{r['blocks']:>6} {r['bytes'] / 2**20:7.2f}  {gbps(r['bytes'], r['save_s'])}    "
              f"{gbps(r['bytes'], r['load_s'])}    {r['roundtrip_ok']}")  # fmt: skip
    print(
        "baselines: GB/s  d2h .cpu()  d2h pageable  d2h pinned  d2h registered  h2d pageable  "
        "h2d pinned  h2d registered"
    )
    for b in base:
        n = b["bytes"]
        print(f"{b['model']:<12} {b['blocks']:>4} blocks   {gbps(n, b['d2h_cpu_s'])}     "
              f"{gbps(n, b.get('d2h_pageable_s'))}       "
              f"{gbps(n, b.get('d2h_pinned_s'))}     {gbps(n, b.get('d2h_registered_s'))}        "
              f"{gbps(n, b.get('h2d_pageable_s'))}       {gbps(n, b.get('h2d_pinned_s'))}     "
              f"{gbps(n, b.get('h2d_registered_s'))}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdd bench gpu-kv-copy", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/gpu_kv_copy"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny layout, any device (CI check)")
    args = ap.parse_args(argv)
    if args.smoke:
        global NUM_BLOCKS, SLOTS
        NUM_BLOCKS, SLOTS = 600, 512
        models = list(SMOKE_MODELS)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --smoke)")
        models, device = list(MODELS), torch.device("cuda")
    rows, base = [], []
    for model in models:
        r, b = run_model(model, device, args.reps)
        rows += r
        base += b
    report(rows, base)
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device),
            "name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "num_blocks": NUM_BLOCKS, "slots": SLOTS, "reps": args.reps}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    path.write_text(json.dumps({"meta": meta, "copies": rows, "baselines": base}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
