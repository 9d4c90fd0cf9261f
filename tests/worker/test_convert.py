"""Proto <-> engine type mapping and worker command-line checks (no engine)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdd.cache.messages import DrcEventBatch, DrcSnapshot
from pdd.engine.types import EngineDelta, SamplingSpec, TokenLogprob, TopLogprob
from pdd.errors import InvalidRequestError
from pdd.proto import worker_pb2 as pb
from pdd.worker import convert
from pdd.worker.convert import delta_to_proto, sampling_from_proto
from pdd.worker.roles import (
    AwaitKvResult,
    CancelKvCall,
    DrcEventsResult,
    KvAddress,
    KvDestination,
    PrepareKvCall,
    PrepareKvResult,
    SendKvCall,
    SendKvResult,
)


def test_proto_zero_values_mean_defaults() -> None:
    spec = sampling_from_proto(pb.SamplingParams())
    assert spec == SamplingSpec(
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        max_tokens=None,
        seed=None,
        logprobs=0,
        repetition_penalty=1.0,
    )
    assert spec.greedy


def test_proto_values_carry_over() -> None:
    p = pb.SamplingParams(
        temperature=0.5,
        top_p=0.25,
        top_k=40,
        max_tokens=7,
        stop_token_ids=[2, 30],
        seed=0,
        logprobs=-1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.25,
        ignore_eos=True,
        min_tokens=3,
        prior_output_tokens=4,
        logit_bias={9: -100.0, 2: 1.5},
        min_p=0.125,
        allowed_token_ids=[9, 2, 40],
        prompt_logprobs=0,
        bad_words=[pb.TokenIds(ids=[5, 6]), pb.TokenIds(ids=[7])],
    )
    assert sampling_from_proto(p) == SamplingSpec(
        temperature=0.5,
        top_p=0.25,
        top_k=40,
        max_tokens=7,
        stop_token_ids=(2, 30),
        seed=0,  # explicitly set zero seed is kept (optional field)
        logprobs=None,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.25,
        ignore_eos=True,
        min_tokens=3,
        prior_output_tokens=4,
        logit_bias=((2, 1.5), (9, -100.0)),
        min_p=0.125,
        allowed_token_ids=(9, 2, 40),
        prompt_logprobs=0,  # set zero is kept (optional field): the prompt token's own
        bad_words=((5, 6), (7,)),
    )


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (pb.SamplingParams(temperature=-0.1), "temperature"),
        (pb.SamplingParams(top_p=1.5), "top_p"),
        (pb.SamplingParams(top_k=-2), "top_k"),
        (pb.SamplingParams(max_tokens=-1), "max_tokens"),
        (pb.SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
        (pb.SamplingParams(logprobs=21), "logprobs"),
        (pb.SamplingParams(presence_penalty=3), "presence_penalty"),
        (pb.SamplingParams(repetition_penalty=-1), "repetition_penalty"),
        (pb.SamplingParams(stop_token_ids=[-5]), "stop_token_ids"),
        (pb.SamplingParams(repetition_penalty=101), "repetition_penalty"),
        (pb.SamplingParams(min_p=1.5), "min_p"),
        (pb.SamplingParams(logit_bias={3: 200.0}), "logit_bias"),
        (pb.SamplingParams(logit_bias={-3: 1.0}), "logit_bias"),
        (pb.SamplingParams(allowed_token_ids=[-1]), "allowed_token_ids"),
        (pb.SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
        (pb.SamplingParams(bad_words=[pb.TokenIds(ids=[])]), "bad_words"),
    ],
)
def test_bad_sampling_is_invalid_request(params: pb.SamplingParams, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        sampling_from_proto(params)
    assert info.value.param == param


def test_delta_to_proto_first_and_later() -> None:
    lp = TokenLogprob(7, -0.5, (TopLogprob(7, -0.5), TopLogprob(9, -1.5)), rank=1)
    prompt = (TokenLogprob(3, -2.5, (), rank=4),)
    d = EngineDelta((7,), (lp,), None, None, num_prompt_tokens=5, num_cached_tokens=4,
                    prompt_logprobs=prompt)  # fmt: skip
    first = delta_to_proto(d, first=True)
    assert [(p.token_id, p.logprob, p.rank) for p in first.prompt_logprobs] == [(3, -2.5, 4)]
    assert list(first.token_ids) == [7]
    assert (first.num_prompt_tokens, first.num_cached_tokens) == (5, 4)
    assert (first.finish_reason, first.stop_token_id) == ("", -1)
    assert [(t.token_id, t.logprob) for t in first.logprobs[0].top] == [(7, -0.5), (9, -1.5)]
    last = EngineDelta((2,), None, "stop", 2, num_prompt_tokens=5, num_cached_tokens=4)
    later = delta_to_proto(last, first=False)
    assert (later.num_prompt_tokens, later.finish_reason, later.stop_token_id) == (0, "stop", 2)
    assert len(later.logprobs) == 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pdd.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_role_mismatch_refused_before_any_engine() -> None:
    r = run_cli("prefill", "--config", "configs/colocated.yaml", "--worker", "w0")
    assert r.returncode == 2
    assert "worker 'w0' has role colocated, not prefill" in r.stderr
    assert r.stdout == ""


def test_unknown_worker_refused() -> None:
    r = run_cli("worker", "--config", "configs/colocated.yaml", "--worker", "nope")
    assert r.returncode == 2
    assert "no worker with id 'nope'" in r.stderr


def test_constraint_from_proto():
    from pdd.engine.types import ConstraintSpec

    c = pb.Constraint(kind="choice", spec='["a", "b"]', resume=[4, 5], param="guided_choice")
    spec = sampling_from_proto(pb.SamplingParams(max_tokens=3), c)
    assert spec.constraint == ConstraintSpec("choice", '["a", "b"]', (4, 5), "guided_choice")
    assert sampling_from_proto(pb.SamplingParams(max_tokens=3)).constraint is None


ADDRESS = pb.PeerAddress(
    transport="tcp", host="10.0.0.2", port=7001, ucx_address=b"\x01\x02", host_id="boot",
    name="md-0",
)  # fmt: skip


def test_kv_calls_carry_every_field_of_their_requests() -> None:
    """Roles see pdd dataclasses, field for field the wire's messages (pdd.worker.convert)."""
    dest = pb.KvDestination(peer=ADDRESS, first_block=3, landing_key="k" * 12)
    send = pb.SendKvRequest(kv_request_id="r", destinations=[dest], deadline_s=2.5)
    addr = KvAddress("tcp", "10.0.0.2", 7001, b"\x01\x02", "boot", "md-0")
    assert convert.send_kv_call(send) == SendKvCall("r", (KvDestination(addr, 3, "k" * 12),), 2.5)
    assert addr.peer().key() == "md-0" and addr.peer().ucx_address == b"\x01\x02"
    prep = pb.PrepareKvRequest(kv_request_id="r", prompt_token_ids=[1, 2], lease_s=9,
                               cache_salt="t")  # fmt: skip
    assert convert.prepare_kv_call(prep) == PrepareKvCall("r", (1, 2), 9.0, "t")
    cancel = pb.CancelKvRequest(kv_request_id="r", reason="switch")
    assert convert.cancel_kv_call(cancel) == CancelKvCall("r", "switch")


def test_kv_results_go_back_to_the_wire_unchanged() -> None:
    addr = convert.address_from_proto(ADDRESS)
    assert convert.address_to_proto(addr) == ADDRESS
    assert convert.address_to_proto(KvAddress()) == pb.PeerAddress()
    prepared = convert.prepare_kv_response(PrepareKvResult(2, 5, addr, "key"))
    assert prepared == pb.PrepareKvResponse(
        cached_blocks=2, reserved_blocks=5, address=ADDRESS, landing_key="key"
    )
    sent = convert.send_kv_response(SendKvResult(4, (10, 20), (5, 20)))
    assert sent == pb.SendKvResponse(
        staged_blocks=4, bytes_per_destination=[10, 20], wire_bytes_per_destination=[5, 20]
    )
    done = convert.await_kv_response(AwaitKvResult("failed", 64, 1, "cut"))
    assert done == pb.AwaitKvResponse(state="failed", bytes_received=64, blocks_ready=1,
                                      reason="cut")  # fmt: skip


def test_a_drc_feed_travels_as_json_and_says_which_kind_it_is() -> None:
    snap = DrcSnapshot(epoch="e", seq=3, block_size=4, block_hashes=())
    batch = DrcEventBatch(epoch="e", block_size=4, last_seq=3, events=())
    for feed, is_snapshot in ((snap, True), (batch, False)):
        resp = convert.drc_events_response(DrcEventsResult(feed))
        assert (resp.snapshot, resp.json) == (is_snapshot, feed.model_dump_json())
