"""chain_speculative_sampling preserves the target distribution."""
import pytest
import torch

from tandem.backends.engine.sampler import filtered_probs
from tandem.backends.speculative import chain_speculative_sampling

N_SAMPLES, VOCAB, N_DRAFT = 40000, 8, 3


def run(p, q, seed=0):
    """p [n+1, V], q [n, V] shared by every row; drafts drawn from q as a draft model would."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[i], N_SAMPLES, replacement=True, generator=g)
                          for i in range(q.shape[0])], 1)
    out, acc, emit = chain_speculative_sampling(
        q.expand(N_SAMPLES, -1, -1), drafts, p.expand(N_SAMPLES, -1, -1), generator=g)
    return out, acc, emit


def tv_per_position(out, p, min_samples=2000):
    tvs = []
    for j in range(p.shape[0]):
        col = out[:, j]
        col = col[col >= 0].long()
        if len(col) < min_samples:
            continue
        freq = torch.bincount(col, minlength=p.shape[1]).float() / len(col)
        tvs.append(0.5 * (freq - p[j]).abs().sum().item())
    return tvs


def rand_dist(n, g, zero_mask=None):
    x = torch.rand(n, VOCAB, generator=g) ** 3
    if zero_mask is not None:
        x = x * ~zero_mask
    return x / x.sum(-1, keepdim=True)


g = torch.Generator().manual_seed(42)
P = rand_dist(N_DRAFT + 1, g)
CASES = {
    "random": (P, rand_dist(N_DRAFT, g)),
    "q_zero_where_p_positive": (P, rand_dist(N_DRAFT, g, zero_mask=torch.arange(VOCAB) < 4)),
    "p_zero_where_q_positive": (rand_dist(N_DRAFT + 1, g, zero_mask=torch.arange(VOCAB) >= 5),
                                rand_dist(N_DRAFT, g)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_follow_the_target_distribution(case):
    p, q = CASES[case]
    out, _, _ = run(p, q)
    tvs = tv_per_position(out, p)
    assert tvs and max(tvs) < 0.02, tvs
    # the test can fail: the draft's own distribution is far from p
    assert max(tv_per_position(torch.cat([torch.multinomial(q[0], N_SAMPLES, True)[:, None]], 1),
                               p[:1])) > 0.05


def test_p_equal_q_accepts_everything():
    p = rand_dist(N_DRAFT + 1, torch.Generator().manual_seed(3))
    out, acc, emit = run(p, p[:N_DRAFT])
    assert (emit == N_DRAFT).all() and (acc == N_DRAFT).all()
    assert (out >= 0).all()
    assert max(tv_per_position(out, p)) < 0.02


def test_with_top_k_and_top_p_applied_to_both():
    g = torch.Generator().manual_seed(5)
    tl, dl = torch.randn(N_DRAFT + 1, VOCAB, generator=g) * 2, torch.randn(N_DRAFT, VOCAB, generator=g) * 2
    f = lambda l: filtered_probs(l, torch.full((len(l),), 0.8), torch.full((len(l),), 5),
                                 torch.full((len(l),), 0.9))
    p, q = f(tl), f(dl)
    out, _, _ = run(p, q)
    assert max(tv_per_position(out, p)) < 0.02
    assert all(p[j][out[:, j][out[:, j] >= 0].long()].min() > 0 for j in range(N_DRAFT + 1))


def test_greedy_one_hot_drafts_and_counters_accumulate():
    # target argmax: 2, 2, 1, then 3; draft proposes 2, 2, 0 -> accept 2, reject the third
    p = torch.nn.functional.one_hot(torch.tensor([[2, 2, 1, 3]]), VOCAB).float()
    q = torch.nn.functional.one_hot(torch.tensor([[2, 2, 0]]), VOCAB).float()
    acc_total = torch.zeros(1, dtype=torch.int32)
    emit_total = torch.zeros(1, dtype=torch.int32)
    for _ in range(2):
        out, acc, emit = chain_speculative_sampling(q, torch.tensor([[2, 2, 0]]), p,
                                                    acc_total, emit_total)
    assert out.tolist() == [[2, 2, 1, -1]]
    assert acc.tolist() == [2] and emit.tolist() == [2]
    assert acc_total.tolist() == [4] and emit_total.tolist() == [4]


def test_greedy_shortcut_equals_one_hot_rejection_sampling():
    from tandem.backends import SamplingParams
    from tandem.backends.engine.sampler import verify_drafts
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(64, 4, 6, generator=g)
    best = logits.argmax(-1)
    # drafts that agree with the argmax for a random prefix, then maybe not
    drafts = torch.where(torch.rand(64, 3, generator=g) < 0.7, best[:, :3],
                         torch.randint(0, 6, (64, 3), generator=g))
    out, emitted = verify_drafts(logits, drafts, [SamplingParams(temperature=0)] * 64, [0] * 64)
    p = torch.nn.functional.one_hot(best, 6).float()
    q = torch.nn.functional.one_hot(drafts, 6).float()
    ref_out, _, ref_emit = chain_speculative_sampling(q, drafts, p)
    assert torch.equal(out, ref_out) and emitted == ref_emit.tolist()
    assert 0 < sum(emitted) < 64 * 3


@pytest.mark.parametrize("n", range(0, 17))
def test_every_k_adaptive_speculation_can_choose_keeps_the_distribution(n):
    """Adaptive speculation verifies any k in 0..MAX_NUM_SPECULATIVE_TOKENS drafts (0: a
    sampling step): every emitted position follows the target's distribution."""
    from tandem.backends.speculative.config import MAX_NUM_SPECULATIVE_TOKENS
    assert n <= MAX_NUM_SPECULATIVE_TOKENS
    g = torch.Generator().manual_seed(100 + n)
    p = rand_dist(n + 1, g)
    q = 0.6 * p[:n] + 0.4 * rand_dist(n, g)     # close enough that late positions are reached
    if n == 0:
        out, _, emit = chain_speculative_sampling(torch.zeros(N_SAMPLES, 0, VOCAB),
                                                  torch.zeros(N_SAMPLES, 0, dtype=torch.long),
                                                  p.expand(N_SAMPLES, -1, -1), generator=g)
        assert (emit == 0).all()
    else:
        out, _, _ = run(p, q, seed=n)
    tvs = tv_per_position(out, p, min_samples=8000)   # fewer samples: more noise than 0.02
    assert tvs and max(tvs) < 0.02, tvs
