"""Sampling maths: filters, seeds, greedy."""
import pytest
import torch

from tandem.backends import SamplingParams
from tandem.backends.engine.sampler import filtered_probs, sample


def probs_for(logits, t=1.0, k=0, p=1.0):
    n = logits.shape[0]
    return filtered_probs(logits, torch.full((n,), t), torch.full((n,), k), torch.full((n,), p))


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.randn(4, 50)
    probs = probs_for(logits, k=5)
    assert ((probs > 0).sum(-1) == 5).all()
    top = logits.topk(5).indices
    assert torch.equal(probs.gather(-1, top).sum(-1) > 0.999, torch.ones(4, dtype=torch.bool))


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert (probs_for(logits, p=0.7) > 0).sum() == 2      # 0.5 < 0.7 <= 0.8
    assert (probs_for(logits, p=0.8) > 0).sum() == 2
    assert (probs_for(logits, p=0.81) > 0).sum() == 3
    assert (probs_for(logits, p=0.01) > 0).sum() == 1     # the top token always stays


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    assert probs_for(logits, t=0.5)[0, 0] > probs_for(logits, t=1.0)[0, 0] > probs_for(logits, t=2.0)[0, 0]


def test_filtered_probs_are_distributions():
    probs = probs_for(torch.randn(8, 100) * 3, t=0.7, k=20, p=0.9)
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, 64)
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[1:2], [seeded], [5])
    in_batch = sample(logits, [SamplingParams(temperature=0.0), seeded, SamplingParams()], [0, 5, 9])
    assert in_batch[1] == alone[0]
    assert in_batch[0] == int(logits[0].argmax())


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    for params in (SamplingParams(), SamplingParams(seed=3)):
        counts = torch.zeros(3)
        for t in range(3000):       # unseeded: torch's generator; seeded: one uniform per position
            counts[sample(logits, [params], [t])[0]] += 1
        torch.testing.assert_close(counts / 3000, torch.tensor([0.6, 0.3, 0.1]), atol=0.03, rtol=0)


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("max_tokens", -3),
                                         ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
                                         ("top_k", -1), ("seed", -1)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
