"""pdd.engine.penalties against vLLM's own penalty code: a tier that continues a request
(the emitted tokens now in its prompt) penalizes exactly as one engine that emitted them all.

The oracle is ``vllm.model_executor.layers.utils.apply_penalties`` (what vLLM's sampler runs):
colocated = prompt P, output E + O; tier 2 = prompt P + E, output O, after the processor."""

from __future__ import annotations

import random

import pytest
import torch
from vllm import SamplingParams
from vllm.model_executor.layers.utils import apply_penalties
from vllm.v1.sample.logits_processor import BatchUpdate

from pdd.engine.penalties import EXTRA_KEY, PriorOutputPenalties, prior_extra

VOCAB = 64


def _vllm(logits, prompt, output, presence, frequency, repetition):
    row = lambda ids: torch.tensor([ids or [VOCAB]], dtype=torch.long)  # noqa: E731 (VOCAB pads)
    f = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    return apply_penalties(logits.clone(), row(prompt), row(output), f(presence), f(frequency),
                           f(repetition))  # fmt: skip


def _tier2(logits, prompt, emitted, output, presence, frequency, repetition):
    proc = PriorOutputPenalties(None, torch.device("cpu"), False)
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition,
                            extra_args={EXTRA_KEY: prior_extra(len(emitted), presence, frequency)})  # fmt: skip
    out = list(output)
    proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[],
                                  added=[(0, params, list(prompt) + list(emitted), out)]))  # fmt: skip
    x = proc.apply(logits.clone())
    return _vllm(x, list(prompt) + list(emitted), out, presence, frequency, repetition)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("repetition", [1.0, 1.3, 0.8])
def test_a_continuing_tier_penalizes_like_one_engine(seed: int, repetition: float):
    rng = random.Random(seed)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
    emitted = [rng.randrange(VOCAB // 2) for _ in range(rng.randrange(1, 30))]  # repeats
    output = [rng.randrange(VOCAB // 2) for _ in range(rng.randrange(0, 10))]
    presence, frequency = rng.uniform(-2, 2), rng.uniform(-2, 2)
    want = _vllm(logits, prompt, emitted + output, presence, frequency, repetition)
    got = _tier2(logits, prompt, emitted, output, presence, frequency, repetition)
    # the same penalties added in another order (and, with r != 1, through the inverse of
    # vLLM's scaling): equal to float rounding
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert int(got.argmax()) == int(want.argmax())


def test_without_the_processor_the_penalties_restart_at_the_tier_change():
    """What the processor fixes: vLLM alone forgets the earlier tiers' tokens."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0  # the favourite, emitted 3 times already
    colocated = _vllm(logits, [1, 2], [5, 5, 5], 0.0, 0.5, 1.0)
    forgetting = _vllm(logits, [1, 2, 5, 5, 5], [], 0.0, 0.5, 1.0)
    assert int(colocated.argmax()) != 5 and int(forgetting.argmax()) == 5
    assert int(_tier2(logits, [1, 2], [5, 5, 5], [], 0.0, 0.5, 1.0).argmax()) != 5


def test_only_requests_with_a_presence_or_frequency_penalty_and_prior_output_get_a_row():
    assert prior_extra(0, 0.5, 0.5) is None
    assert prior_extra(4, 0.0, 0.0) is None
    assert prior_extra(4, 0.0, -0.1) == 4
    with pytest.raises(ValueError, match=EXTRA_KEY):
        PriorOutputPenalties.validate_params(SamplingParams(extra_args={EXTRA_KEY: -1}))
