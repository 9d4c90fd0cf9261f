"""KV geometry where KV moves and where pairs are chosen: the chunk header (wire v2) carries
what a segment holds; routing never pairs P with an MD or RLD that cannot take its KV and
says why (both workers and the field); the fleet's gate refuses another model."""

from __future__ import annotations

import pytest

from pdd.errors import TransferError, UnavailableError
from pdd.kv_geometry import RECEIVER_CONVERTS, KvGeometry
from pdd.protocol import Pipeline, Role, RouterMode
from pdd.router.decide.routing import FleetView, RouteRequest, choose
from pdd.router.fleet.geometry import GeometryGate
from pdd.transfer import KVSegment, SendRequest
from pdd.transfer.wire import PREFIX, VERSION, ChunkHeader, plan_chunks
from pdd.worker.kv_wire import KvWireCheck, describe, mismatch
from tests.router.test_policy import POLICY, md, p, rld

G = KvGeometry(fingerprint="a" * 32, num_layers=30, total_kv_heads=3, kv_head_end=3,
               head_dim=64, block_size=32, kv_dtype="float32")  # fmt: skip


def test_a_chunk_header_states_what_its_segment_carries():
    seg = KVSegment(bytes(G.block_bytes), block_start=5, block_end=6, **describe(G))
    plan = plan_chunks(7, SendRequest("kv#key", [seg]), G.block_bytes // 3, algo=0)
    assert len(plan) == 3 and VERSION == 2
    for chunk in plan:
        back = ChunkHeader.unpack(chunk.header.pack()[PREFIX.size :])
        assert back == chunk.header
        assert (back.dtype, back.shape, back.layout) == ("float32", (30, 3, 32, 128),
                                                         "cpu_packed_kv")  # fmt: skip
        assert (back.layer_start, back.layer_end, back.kv_head_start, back.kv_head_end) == (
            0, 30, 0, 3)  # fmt: skip
        assert back.token_range == (160, 192) and mismatch(back, G) is None


@pytest.mark.parametrize(
    ("field", "change", "why"),
    [
        ("dtype", {"kv_dtype": "bfloat16"}, "dtype: chunk bfloat16, here float32"),
        ("block", {"block_size": 128}, "block_size: chunk 128, here 32"),
        ("layout", {"layout": "kv_split"}, "layout: chunk kv_split, here cpu_packed_kv"),
        ("heads", {"kv_head_start": 1, "kv_head_end": 2}, "kv_heads: chunk 1, here 3"),
        ("layers", {"num_layers": 15}, "num_layers: chunk 15, here 30"),
    ],
)
def test_a_chunk_of_another_geometry_is_named_by_its_first_differing_field(field, change, why):
    seg = KVSegment(b"x", block_start=0, block_end=1, **describe(G.model_copy(update=change)))
    header = plan_chunks(1, SendRequest("kv", [seg]), 1 << 20, algo=0)[0].header
    assert mismatch(header, G) == why


def test_decoders_take_chunks_in_the_dtype_layout_and_block_size_they_convert_from():
    """MD's and RLD's checks pass a bfloat16 / K-V-split / 128-token chunk and hand back the
    chunk's geometry (its segment is one block in P's geometry); a receiver that converts
    nothing refuses it; another KV-head range still refuses."""
    md = KvWireCheck(G.block_bytes, lambda: G, RECEIVER_CONVERTS[Role.MAIN_DECODE])
    rld = KvWireCheck(G.block_bytes, lambda: G, RECEIVER_CONVERTS[Role.RELAY_DECODE])
    plain = KvWireCheck(G.block_bytes, lambda: G)
    for change in ({"kv_dtype": "bfloat16"}, {"layout": "kv_split"}, {"block_size": 128}):
        src = G.model_copy(update=change)
        seg = KVSegment(bytes(src.block_bytes), block_start=0, block_end=1, **describe(src))
        header = plan_chunks(1, SendRequest("kv", [seg]), 1 << 30, algo=0)[0].header
        assert md(header) == rld(header) == src
        with pytest.raises(TransferError, match="not in this worker's KV geometry"):
            plain(header)
    own = KVSegment(bytes(G.block_bytes), block_start=0, block_end=1, **describe(G))
    assert md(plan_chunks(1, SendRequest("kv", [own]), 1 << 30, algo=0)[0].header) is None
    half = G.model_copy(update={"kv_dtype": "bfloat16", "kv_head_end": 2})
    seg = KVSegment(bytes(half.block_bytes), block_start=0, block_end=1, **describe(half))
    with pytest.raises(TransferError, match="kv_heads: chunk 2, here 3"):
        md(plan_chunks(1, SendRequest("kv", [seg]), 1 << 30, algo=0)[0].header)
    amx = G.model_copy(update={"kv_dtype": "bfloat16", "layout": "cpu_amx"})
    seg = KVSegment(bytes(amx.block_bytes), block_start=0, block_end=1, **describe(amx))
    with pytest.raises(TransferError, match="layout: chunk cpu_amx, here cpu_packed_kv"):
        md(plan_chunks(1, SendRequest("kv", [seg]), 1 << 30, algo=0)[0].header)
    assert (md.refused, rld.refused, plain.refused) == (2, 0, 3)


def test_an_undescribed_chunk_is_not_in_any_geometry():
    header = plan_chunks(1, SendRequest("kv", [KVSegment(b"x", 0, 1)]), 1 << 20, algo=0)[0].header
    assert mismatch(header, G) == "dtype: chunk uint8, here float32"


def _fleet(*workers):
    return FleetView(RouterMode.PDD, tuple(workers), POLICY)


def test_routing_never_pairs_p_with_an_md_that_cannot_take_its_kv():
    other = G.model_copy(update={"kv_head_end": 2})  # a TP shard: not regrouped
    view = _fleet(p(geometry=G), md("md0", geometry=other), md("md1", geometry=G))
    cached = {"md0": 40}  # md0 holds the whole prompt: it would win on its hit
    d = choose(view, RouteRequest(40, 16, md_cached_tokens=cached, pipeline=Pipeline.P_MD))
    assert d.worker(Role.MAIN_DECODE) == "md1"


def test_decoders_of_another_dtype_pair_a_tp_shard_does_not():
    """MD and RLD convert P's dtype on landing: a bfloat16 MD wins on its hit, a bfloat16 RLD
    relays; an RLD holding only some KV heads (not regrouped) is no RLD (p_md)."""
    bf16 = G.model_copy(update={"kv_dtype": "bfloat16"})
    view = _fleet(p(geometry=G), md("md0", geometry=bf16), md("md1", geometry=G),
                  rld("rld0", geometry=bf16))  # fmt: skip
    d = choose(view, RouteRequest(4000, 16, md_cached_tokens={"md0": 4000}))
    assert d.worker(Role.MAIN_DECODE) == "md0" and d.pipeline is Pipeline.P_MD
    d = choose(view, RouteRequest(4000, 16, pipeline=Pipeline.P_RLD_MD))
    assert d.worker(Role.RELAY_DECODE) == "rld0"
    shard = _fleet(p(geometry=G), md("md0", geometry=G),
                   rld("rld0", geometry=G.model_copy(update={"kv_head_end": 2})))  # fmt: skip
    assert choose(shard, RouteRequest(4000, 16)).pipeline is Pipeline.P_MD


def test_no_compatible_md_refuses_the_request_naming_both_workers_and_the_field():
    view = _fleet(p(geometry=G), md("md0", geometry=G.model_copy(update={"num_layers": 15})))
    with pytest.raises(UnavailableError) as err:
        choose(view, RouteRequest(40, 16))
    assert err.value.message == (
        "no main_decode worker can take KV from p0: workers p0 and md0 cannot exchange KV: "
        "num_layers differs (p0: 30, md0: 15)"
    )


def test_p_and_rld_are_chosen_among_the_workers_that_can_pair():
    bad = G.model_copy(update={"fingerprint": "b" * 32})
    view = _fleet(p("p0", geometry=bad), p("p1", geometry=G), rld("rld0", geometry=bad),
                  rld("rld1", geometry=G), md("md0", geometry=G))  # fmt: skip
    d = choose(view, RouteRequest(40, 16, pipeline=Pipeline.P_RLD_MD))
    assert d.assignments == ((Role.PREFILL, "p1"), (Role.RELAY_DECODE, "rld1"),
                             (Role.MAIN_DECODE, "md0"))  # fmt: skip
    forced = _fleet(p("p1", geometry=G), rld("rld0", geometry=bad), md("md0", geometry=G))
    with pytest.raises(UnavailableError, match="no relay_decode worker can take KV from p1: "
                       "workers p1 and rld0 cannot exchange KV: fingerprint differs"):  # fmt: skip
        choose(forced, RouteRequest(40, 16, pipeline=Pipeline.P_RLD_MD))
    # not forced: an incompatible RLD is no RLD (p_md), never a pair
    d = choose(forced, RouteRequest(4000, 16))
    assert d.pipeline is Pipeline.P_MD


def test_workers_without_a_geometry_pair_as_before():
    d = choose(_fleet(p(), md("md0", geometry=G)), RouteRequest(40, 16))
    assert d.worker(Role.MAIN_DECODE) == "md0"


def test_the_gate_admits_the_fleets_model_only():
    gate = GeometryGate(G, "router model /m")
    assert gate.refusal("md0", G.model_copy(update={"kv_dtype": "bfloat16"})) is None
    assert gate.refusal("md0", None) is None
    why = gate.refusal("md1", G.model_copy(update={"fingerprint": "c" * 32}))
    assert why == ("not admitted: workers md1 and router model /m cannot exchange KV: "
                   f"fingerprint differs (md1: {'c' * 32}, router model /m: {'a' * 32})")  # fmt: skip
    first = GeometryGate(None, "")
    assert first.refusal("p0", G) is None and first.source == "p0"
    assert "head_dim differs" in first.refusal("md0", G.model_copy(update={"head_dim": 32}))


def test_a_replacement_p_can_send_to_the_requests_receivers():
    from pdd.router.decide.recovery import replacement

    shard = G.model_copy(update={"kv_head_end": 2})
    view = _fleet(p("p0", geometry=G), p("p1", geometry=shard), p("p2", geometry=G, in_flight=3),
                  md("md0", geometry=G))  # fmt: skip
    assert replacement(view, Role.PREFILL, ["p0"], ["md0"]).id == "p2"  # p1 is idler: a shard
    assert replacement(view, Role.PREFILL, ["p0"]).id == "p1"  # no receivers: any P
    assert replacement(view, Role.PREFILL, ["p0", "p2"], ["md0"]) is None
