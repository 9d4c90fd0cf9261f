"""TorchBlockCopier (pdd/engine/kv_copy.py): layout detection, wire layout, exact round trips.

Real shared-memory arenas (``SlotArena``), KV tensors shaped like vLLM's layouts with random
contents. Imports no vLLM (runs on the GPU machine, which has none); the one test that compares
with the numpy path of connector_worker skips without vLLM. CUDA tests skip without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from pdd.cache.arena import SlotArena
from pdd.engine.kv_copy import (
    BLOCK_FIRST,
    KV_SPLIT,
    HeadShard,
    PagedLayers,
    TorchBlockCopier,
    _HostPins,
    _runs,
    detect_block_dim,
)
from pdd.errors import CacheError, ConfigError

N = 9  # blocks per layer
LAYERS = 3
H, B, D = 2, 4, 8  # kv heads, block size, head dim
SLOTS = 8
PREFIX = "pddtest-kvcopy"
# name -> (logical shape, physical order to allocate in, or None for contiguous)
LAYOUTS = {
    "cpu-packed": ((N, H, B, 2 * D), None),  # [N, H, B, 2D], vLLM CPU / FlashAttention 0.32
    "flashinfer": ((N, 2, B, H, D), None),  # [N, 2, B, H, D]
    "flashinfer-hnd": ((N, 2, B, H, D), (0, 1, 3, 2, 4)),  # same, stored [N, 2, H, B, D]
    "kv-split": ((2, N, B, H, D), None),  # [2, N, B, H, D], FlashAttention before 0.32
}
DTYPES = [torch.float32, torch.bfloat16]
cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (this machine has none; these ran on an H200: "
    "docs/results/gpu-kv-copy/pytest-h200.log)",
)


# the KV-head dim of each layout's logical per-layer tensor
HEAD_DIM = {"cpu-packed": 1, "flashinfer": 3, "flashinfer-hnd": 3, "kv-split": 3}


def make_caches(
    layout: str, dtype, seed: int, device="cpu", heads: int = H
) -> dict[str, torch.Tensor]:
    shape, order = LAYOUTS[layout]
    shape = (*shape[: HEAD_DIM[layout]], heads, *shape[HEAD_DIM[layout] + 1 :])
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        if order is None:
            t = torch.randn(shape, generator=g)
        else:  # allocate in physical order, hand over the logical view (as vLLM does)
            t = torch.randn([shape[d] for d in order], generator=g).permute(
                *[order.index(d) for d in range(len(order))]
            )
        out[f"layers.{i}.attn"] = t.to(dtype).to(device)
    return out


def block_bytes(t: torch.Tensor, b: int, block_dim: int) -> bytes:
    """Documented wire layout of block b of one layer: t[b], or t[0, b] then t[1, b]."""
    blk = t[b] if block_dim == BLOCK_FIRST else torch.stack([t[0, b], t[1, b]])
    return blk.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def slot_of(caches: dict[str, torch.Tensor], b: int, block_dim: int) -> bytes:
    return b"".join(block_bytes(t, b, block_dim) for t in caches.values())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(
        a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8)
    )


@pytest.fixture
def arena_of():
    made: list[SlotArena] = []

    def make(layers: PagedLayers, num_slots: int = SLOTS) -> SlotArena:
        arena = SlotArena.create(num_slots, layers.block_bytes, PREFIX)
        made.append(arena)
        arena.buffer[:] = torch.randint(0, 256, (arena.ref.nbytes,), dtype=torch.uint8).numpy()
        return arena

    yield make
    for arena in made:
        arena.close()
        arena.unlink()


@pytest.fixture
def copier_of(arena_of):
    """TorchBlockCopier factory; closes them all (unregistering the arenas) before the arenas."""
    made: list[TorchBlockCopier] = []

    def make(layers: PagedLayers, arena: SlotArena, **kw) -> TorchBlockCopier:
        made.append(TorchBlockCopier(layers, arena, **kw))
        return made[-1]

    yield make
    for copier in made:
        copier.close()
    assert _HostPins._count == {}  # every registration was released


def slots_bytes(arena: SlotArena) -> list[bytes]:
    return [bytes(arena.view(s)) for s in range(arena.num_slots)]


# --- layout detection -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, num_blocks, dim",
    [
        ((9, 2, 4, 16), None, BLOCK_FIRST),  # CPU / FlashAttention 0.32 packed
        ((9, 2, 4, 16), 9, BLOCK_FIRST),
        ((9, 2, 4, 2, 8), None, BLOCK_FIRST),  # FlashInfer
        ((9, 2, 4, 2, 8), 9, BLOCK_FIRST),
        ((2, 9, 4, 2, 8), None, KV_SPLIT),  # FlashAttention before 0.32
        ((2, 9, 4, 2, 8), 9, KV_SPLIT),
        ((9, 16, 576), None, BLOCK_FIRST),  # MLA latent
        ((2, 3, 4, 16), 2, BLOCK_FIRST),  # two blocks: only the count tells
    ],
)
def test_detect_block_dim(shape, num_blocks, dim):
    assert detect_block_dim(shape, num_blocks) == dim


@pytest.mark.parametrize(
    "shape, num_blocks, why",
    [
        ((2, 2, 4, 2, 8), None, "ambiguous"),
        ((2, 2, 4, 2, 8), 2, "ambiguous"),
        ((7, 2, 4, 16), 9, "not a supported layout"),
        ((2, 7, 4, 2, 8), 9, "not a supported layout"),
        ((2, 16), None, "not a supported layout"),
        ((9,), None, "not a supported layout"),
    ],
)
def test_unknown_or_ambiguous_shapes_are_refused_by_name(shape, num_blocks, why):
    with pytest.raises(ConfigError, match=rf"KV cache shape {shape!r}.*{why}".replace("(", r"\(")
                       .replace(")", r"\)")):  # fmt: skip
        detect_block_dim(shape, num_blocks)


def test_layers_that_differ_are_refused():
    caches = make_caches("flashinfer", torch.float32, 1)
    caches["layers.1.attn"] = caches["layers.1.attn"][:, :, :2]
    with pytest.raises(ConfigError, match=r"KV layer layers\.1\.attn: \(9, 2, 2, 2, 8\)"):
        PagedLayers.from_caches(caches)
    caches = make_caches("kv-split", torch.float32, 1)
    caches["layers.2.attn"] = caches["layers.2.attn"].to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"layers\.2\.attn: \(2, 9, 4, 2, 8\) torch.bfloat16"):
        PagedLayers.from_caches(caches)


def test_an_arena_of_the_wrong_slot_size_is_refused(arena_of):
    layers = PagedLayers.from_caches(make_caches("kv-split", torch.bfloat16, 1))
    wrong = PagedLayers.from_caches(make_caches("kv-split", torch.float32, 1))
    arena = arena_of(wrong)
    with pytest.raises(
        ConfigError, match="arena has 1536-byte slots, but one KV block of this engine is 768 bytes"
    ):
        TorchBlockCopier(layers, arena)


def test_layer_geometry():
    layers = PagedLayers.from_caches(make_caches("kv-split", torch.bfloat16, 1), num_blocks=N)
    assert (layers.block_dim, layers.num_blocks, layers.block_shape) == (KV_SPLIT, N, (2, B, H, D))
    assert (layers.layer_block_bytes, layers.block_bytes) == (2 * B * H * D * 2, 3 * 256)
    assert not layers.is_cpu_packed
    assert PagedLayers.from_caches(make_caches("cpu-packed", torch.float32, 1)).is_cpu_packed
    assert not PagedLayers.from_caches(
        make_caches("flashinfer-hnd", torch.float32, 1)
    ).is_cpu_packed


def test_runs_coalesce_consecutive_slots():
    assert _runs([7, 8, 9, 2, 3, 5]) == [(0, 7, 3), (3, 2, 2), (5, 5, 1)]
    assert _runs([3, 2, 1]) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]
    assert _runs([]) == []


# --- copies on CPU tensors ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_writes_the_documented_wire_layout(arena_of, copier_of, layout, dtype):
    caches = make_caches(layout, dtype, 1)
    layers = PagedLayers.from_caches(caches, N)
    arena = arena_of(layers)
    before = slots_bytes(arena)
    copier = copier_of(layers, arena)
    copier.save((5, 0, 8), (3, 6, 1))
    copier.close()
    after = slots_bytes(arena)
    for b, s in ((5, 3), (0, 6), (8, 1)):
        assert after[s] == slot_of(caches, b, layers.block_dim)
    assert [after[s] for s in (0, 2, 4, 5, 7)] == [before[s] for s in (0, 2, 4, 5, 7)]


def roundtrip(arena_of, copier_of, layout, dtype, device="cpu", **copier_kw):
    """Save blocks of cache A to slots, load them into cache B at other ids; check both."""
    a = make_caches(layout, dtype, 1, device)
    b = make_caches(layout, dtype, 2, device)
    b_before = {k: t.clone() for k, t in b.items()}
    saved, slots, loaded = (5, 0, 8, 3, 1), (3, 6, 1, 2, 7), (2, 7, 4, 0, 6)
    la, lb = PagedLayers.from_caches(a, N), PagedLayers.from_caches(b, N)
    arena = arena_of(la)
    before = slots_bytes(arena)
    ca, cb = copier_of(la, arena, **copier_kw), copier_of(lb, arena, **copier_kw)
    ca.save(saved, slots)
    after_save = slots_bytes(arena)
    cb.load(slots, loaded)
    assert slots_bytes(arena) == after_save  # a load never writes the arena
    ca.close()
    cb.close()
    for s, blk in zip(slots, saved, strict=True):
        assert after_save[s] == slot_of(a, blk, la.block_dim)
    assert [after_save[s] for s in (0, 4, 5)] == [before[s] for s in (0, 4, 5)]
    bd = la.block_dim
    for name in a:
        got = b[name].index_select(bd, torch.tensor(loaded, device=device))
        want = a[name].index_select(bd, torch.tensor(saved, device=device))
        assert same_bits(got, want), name
        others = torch.tensor([i for i in range(N) if i not in loaded], device=device)
        assert same_bits(b[name].index_select(bd, others), b_before[name].index_select(bd, others))
    return ca, cb


@pytest.mark.parametrize("chunk_blocks", [1, 2, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_then_load_into_another_cache_is_bit_identical(
    arena_of, copier_of, layout, dtype, chunk_blocks
):
    bytes_per_block = LAYERS * H * B * 2 * D * torch.empty((), dtype=dtype).element_size()
    ca, _ = roundtrip(
        arena_of, copier_of, layout, dtype, chunk_bytes=chunk_blocks * bytes_per_block
    )
    assert (ca.host, ca.chunk_blocks) == ("cpu", chunk_blocks)


def test_out_of_range_ids_raise_and_copy_nothing(arena_of, copier_of):
    caches = make_caches("kv-split", torch.float32, 1)
    layers = PagedLayers.from_caches(caches, N)
    arena = arena_of(layers)
    before = slots_bytes(arena)
    copier = copier_of(layers, arena)
    with pytest.raises(CacheError, match=r"block id out of range \[0, 9\)"):
        copier.save((1, 9), (0, 1))
    with pytest.raises(CacheError, match=r"slot out of range \[0, 8\)"):
        copier.save((1, 2), (0, 8))
    with pytest.raises(CacheError, match=r"block id out of range"):
        copier.load((0,), (-1,))
    with pytest.raises(CacheError, match="2 blocks but 1 slots"):
        copier.save((1, 2), (0,))
    copier.close()
    with pytest.raises(CacheError, match="closed"):
        copier.save((1,), (0,))
    assert slots_bytes(arena) == before


def test_numpy_path_and_torch_path_agree_on_the_cpu_layout(arena_of, copier_of):
    pytest.importorskip(  # vLLM is always installed by `make test`; the GPU machine lacks it
        "vllm", reason="pdd.engine.connector_worker imports vLLM's connector message classes"
    )
    from pdd.engine.connector_worker import PagedKv, SlotCopier

    caches = make_caches("cpu-packed", torch.bfloat16, 3)
    layers = PagedLayers.from_caches(caches)
    a1, a2 = arena_of(layers), arena_of(layers)
    a1.buffer[:] = a2.buffer
    numpy_copier, torch_copier = SlotCopier(PagedKv(caches), a1), copier_of(layers, a2)
    numpy_copier.save((4, 2, 7), (0, 5, 6))
    torch_copier.save((4, 2, 7), (0, 5, 6))
    numpy_copier.close()
    torch_copier.close()
    assert slots_bytes(a1) == slots_bytes(a2)


# --- tensor-parallel ranks: each copies its KV heads of whole slots ------------------------


def ranks_of(whole: dict[str, torch.Tensor], layout: str, world: int, seed: int | None = None):
    """Per rank: its HeadShard and caches of its heads, laid out like ``whole`` (physical order
    kept); the heads' values copied from ``whole``, or random (``seed``) to be loaded into."""
    total = next(iter(whole.values())).shape[HEAD_DIM[layout]]
    out = []
    for r in range(world):
        shard = HeadShard.of_rank(r, world, total)
        device = next(iter(whole.values())).device
        caches = make_caches(layout, next(iter(whole.values())).dtype, seed or 0, device,
                             heads=shard.count)  # fmt: skip
        if seed is None:
            for name, t in caches.items():
                t.copy_(whole[name].narrow(HEAD_DIM[layout], shard.start, shard.count))
        out.append((shard, caches))
    return out


def check_ranks_write_and_read_whole_slots(arena_of, copier_of, layout, heads, world, device,
                                           **copier_kw):  # fmt: skip
    """The ranks' saves fill the slots byte for byte as one engine holding every head would;
    each rank's load takes back exactly its heads."""
    whole = make_caches(layout, torch.bfloat16, 1, device, heads=heads)
    lw = PagedLayers.from_caches(whole, N)
    one, many = arena_of(lw), arena_of(lw)
    one.buffer[:] = many.buffer
    saved, slots, loaded = (5, 0, 8), (3, 6, 1), (2, 7, 4)
    copier_of(lw, one).save(saved, slots)
    for shard, caches in ranks_of(whole, layout, world):
        rank = copier_of(PagedLayers.from_caches(caches, N), many, shard=shard, **copier_kw)
        rank.save(saved, slots)
    assert slots_bytes(many) == slots_bytes(one)
    for shard, caches in ranks_of(whole, layout, world, seed=7):
        rank = copier_of(PagedLayers.from_caches(caches, N), many, shard=shard, **copier_kw)
        rank.load(slots, loaded)
        hd, bd = HEAD_DIM[layout], lw.block_dim
        for name, t in caches.items():
            want = whole[name].narrow(hd, shard.start, shard.count)
            got = t.index_select(bd, torch.tensor(loaded, device=device))
            assert same_bits(got, want.index_select(bd, torch.tensor(saved, device=device)))
    return rank


@pytest.mark.parametrize("heads, world", [(2, 2), (4, 2), (2, 4)], ids=["1-each", "2-each",
                                                                      "replicated"])  # fmt: skip
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensor_parallel_ranks_fill_whole_slots_and_load_their_heads(
    arena_of, copier_of, layout, heads, world
):
    rank = check_ranks_write_and_read_whole_slots(
        arena_of, copier_of, layout, heads, world, "cpu", chunk_bytes=1
    )
    assert rank.chunk_blocks == 1  # a chunk a block: runs of slots split across chunks too


def test_a_rank_whose_blocks_do_not_hold_its_heads_is_refused(arena_of):
    whole = PagedLayers.from_caches(make_caches("kv-split", torch.float32, 1, heads=4), N)
    arena = arena_of(whole)
    rank = PagedLayers.from_caches(make_caches("kv-split", torch.float32, 1, heads=2), N)
    with pytest.raises(ConfigError, match=r"does not hold this rank's 1 of 4 KV heads on its "
                                          r"head axis \(2\)"):  # fmt: skip
        TorchBlockCopier(rank, arena, shard=HeadShard.of_rank(0, 4, 4))
    with pytest.raises(ConfigError, match="arena has 3072-byte slots, but one KV block of this "
                                          "engine is 4608 bytes .*6 heads over the ranks"):  # fmt: skip
        TorchBlockCopier(rank, arena, shard=HeadShard.of_rank(0, 3, 6))
    latent = {f"layers.{i}.attn": torch.zeros(N, B, 576) for i in range(LAYERS)}  # MLA: no heads
    with pytest.raises(ConfigError, match="on its head axis \\(none known\\)"):
        TorchBlockCopier(PagedLayers.from_caches(latent, N), arena, shard=HeadShard(0, 1, 2))


# --- copies on CUDA tensors -----------------------------------------------------------------


@cuda
@pytest.mark.parametrize("host", ["register", "staging"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_save_then_load_is_bit_identical(arena_of, copier_of, layout, dtype, host):
    bytes_per_block = LAYERS * H * B * 2 * D * torch.empty((), dtype=dtype).element_size()
    ca, cb = roundtrip(
        arena_of, copier_of, layout, dtype, "cuda", host=host, chunk_bytes=2 * bytes_per_block
    )
    assert (ca.host, cb.host, ca.chunk_blocks) == (host, host, 2)


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_and_cpu_write_the_same_slot_bytes(arena_of, copier_of, layout):
    cpu = make_caches(layout, torch.bfloat16, 4)
    gpu = {k: t.to("cuda") for k, t in cpu.items()}
    lc, lg = PagedLayers.from_caches(cpu), PagedLayers.from_caches(gpu)
    a1, a2 = arena_of(lc), arena_of(lg)
    a1.buffer[:] = a2.buffer
    cc, cg = copier_of(lc, a1), copier_of(lg, a2)
    cc.save((1, 2, 3, 8), (7, 0, 1, 2))
    cg.save((1, 2, 3, 8), (7, 0, 1, 2))
    assert cg.host == "register"  # "auto" registers the arena when CUDA allows it
    cc.close()
    cg.close()
    assert slots_bytes(a1) == slots_bytes(a2)


@cuda
def test_cuda_out_of_range_ids_raise_before_touching_the_device(arena_of, copier_of):
    caches = make_caches("kv-split", torch.float32, 1, "cuda")
    layers = PagedLayers.from_caches(caches, N)
    copier = copier_of(layers, arena_of(layers))
    with pytest.raises(CacheError, match="block id out of range"):
        copier.load((0,), (N,))
    copier.save((0,), (0,))  # the CUDA context is still usable
    copier.close()


@cuda
def test_cuda_copiers_share_one_registration_of_an_arena(arena_of, copier_of):
    caches = make_caches("flashinfer", torch.bfloat16, 1, "cuda")
    layers = PagedLayers.from_caches(caches, N)
    arena = arena_of(layers)
    first, second = copier_of(layers, arena), copier_of(layers, arena)
    assert (first.host, second.host) == ("register", "register")
    assert list(_HostPins._count.values()) == [2]
    first.close()
    assert list(_HostPins._count.values()) == [1]
    second.save((1, 2), (3, 4))  # still registered, still copying
    assert bytes(arena.view(4)) == slot_of(caches, 2, BLOCK_FIRST)
    second.close()
    assert _HostPins._count == {}
    assert copier_of(layers, arena).host == "register"  # unregistered: registers again


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (this machine and CI have none; not yet run on one): the same "
    "rank copies are checked on CPU tensors of every layout by "
    "test_tensor_parallel_ranks_fill_whole_slots_and_load_their_heads; on CUDA they also go "
    "through pinned staging",
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_tensor_parallel_ranks_fill_whole_slots_through_staging(arena_of, copier_of, layout):
    rank = check_ranks_write_and_read_whole_slots(arena_of, copier_of, layout, 4, 2, "cuda")
    assert rank.host == "staging"  # "auto": a rank's heads are strided in the slot
    four, two = (PagedLayers.from_caches(make_caches(layout, torch.float32, 1, "cuda", heads=h), N)
                 for h in (4, 2))  # fmt: skip
    with pytest.raises(ConfigError, match="host copy mode 'register' cannot"):
        TorchBlockCopier(two, arena_of(four), shard=HeadShard(0, 2, 4), host="register")
