"""A seeded request's draws (seeded_draws.py): verifying greedy drafts with them is
lossless and gives the tokens plain seeded sampling gives, at any k."""
import torch

from tandem.backends.engine.params import SamplingParams
from tandem.backends.engine.sampler import filtered_probs, sample, verify_drafts
from tandem.backends.engine.seeded_draws import inverse_cdf, seeded_uniforms

VOCAB = 8


def test_uniforms_depend_on_seed_and_position_only():
    u = seeded_uniforms(11, range(1000))
    assert len(set(u)) == 1000 and all(0.0 <= x < 1.0 for x in u)
    assert seeded_uniforms(11, [500, 3]) == [u[500], u[3]]
    assert seeded_uniforms(12, range(1000)) != u
    assert abs(sum(u) / len(u) - 0.5) < 0.05


def test_inverse_cdf_never_picks_a_token_of_zero_mass():
    probs = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    edges = torch.tensor([0.0, 0.2999999, 0.3, 0.3000001, 1.0 - 2.0 ** -53])
    assert set(inverse_cdf(probs.expand(5, -1), edges).tolist()) <= {1, 3}


def test_verifying_seeded_drafts_gives_the_tokens_plain_sampling_gives():
    """The same seed and positions: k drafts verified in one step emit what k+1 plain
    steps would have sampled, whatever the drafts were (right, wrong, half right)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=trial)
        k, start = 1 + trial % 4, trial * 3
        logits = torch.randn(1, k + 1, VOCAB, generator=g) * 2
        plain = [sample(logits[0, j:j + 1], [params], [start + j])[0] for j in range(k + 1)]
        drafts = torch.tensor([plain[:k]])
        if trial % 2:   # a wrong draft at a random position
            j = int(torch.randint(0, k, (1,), generator=g))
            drafts[0, j] = (plain[j] + 1) % VOCAB
        out, emitted = verify_drafts(logits, drafts, [params], [start])
        n = emitted[0]
        assert out[0, :n + 1].tolist() == plain[:n + 1]
        assert n == k if trial % 2 == 0 else n == j


def test_seeded_verification_is_lossless():
    """Over many seeds a fixed draft is accepted with probability p(draft) and the first
    emitted token is distributed as p (the rejection sampler's guarantee)."""
    logits = torch.log(torch.tensor([[[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]]))
    p = filtered_probs(logits[0, :1], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))[0]
    drafts = torch.tensor([[1]])
    counts, accepted, n = torch.zeros(4), 0, 4000
    for seed in range(n):
        out, emitted = verify_drafts(logits, drafts, [SamplingParams(temperature=1.0, seed=seed)], [0])
        counts[int(out[0, 0])] += 1
        accepted += emitted[0]
    torch.testing.assert_close(counts / n, p, atol=0.025, rtol=0)
    assert abs(accepted / n - float(p[1])) < 0.025
