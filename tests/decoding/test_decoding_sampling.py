"""Sampling helpers: probabilities by hand, Gumbel top-k and stochastic beam search (chi-square tests on small
vocabularies), the chi-square helper itself. The rejection samplers are tested exactly in test_decoding_exact.py.

Each test draws with a fixed seed and passes when the p-value exceeds `P_VALUE_THRESHOLD` (1e-3), fixed
in advance; nothing is retried.
"""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.sampling import (
    Sampling,
    gumbel_topk,
    probabilities,
    stochastic_beam_step,
    truncated_gumbel,
)
from tests.decoding_helpers import (
    P_VALUE_THRESHOLD,
    chi_square_pvalue,
    random_distribution,
    single_thread_fixture,
)

single_thread = single_thread_fixture()
V = 6


def test_probabilities_temperature_top_k_top_p_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(
        probabilities(logits, Sampling(temperature=1.0)), torch.tensor([0.5, 0.3, 0.15, 0.05])
    )
    # top-p 0.8: 0.5 + 0.3 reaches 0.8, the rest is dropped
    assert torch.allclose(probabilities(logits, Sampling(1.0, top_p=0.8)), torch.tensor([0.625, 0.375, 0, 0]))
    # top-p 0.81 needs the third token too
    assert torch.allclose(
        probabilities(logits, Sampling(1.0, top_p=0.81)), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95
    )
    assert torch.allclose(probabilities(logits, Sampling(1.0, top_k=1)), torch.tensor([1.0, 0, 0, 0]))
    squared = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    assert torch.allclose(probabilities(logits, Sampling(temperature=0.5)), squared / squared.sum())
    with pytest.raises(ValueError, match="greedy"):
        probabilities(logits, Sampling())
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0.0)


def test_gumbel_top_k_samples_without_replacement():
    gen = torch.Generator().manual_seed(3)
    p = random_distribution(4, gen)
    n = 20000
    tokens, _ = gumbel_topk(p.log().expand(n, -1), 2, gen)
    pairs = torch.zeros(4, 4)
    pairs.index_put_((tokens[:, 0], tokens[:, 1]), torch.ones(n), accumulate=True)
    expected = p.view(-1, 1) * p.view(1, -1) / (1 - p.view(-1, 1))
    expected.fill_diagonal_(0)
    assert chi_square_pvalue(pairs, expected * n) > P_VALUE_THRESHOLD


def test_truncated_gumbel_matches_the_direct_formula_and_its_properties():
    gen = torch.Generator().manual_seed(0)
    perturbed = torch.randn(5, 7, generator=gen, dtype=torch.double) * 3
    bound = torch.randn(5, generator=gen, dtype=torch.double)
    top = perturbed.max(-1, keepdim=True).values
    direct = -torch.log(torch.exp(-bound.view(-1, 1)) - torch.exp(-top) + torch.exp(-perturbed))
    stable = truncated_gumbel(perturbed, bound)
    assert torch.allclose(stable, direct, atol=1e-9)
    assert torch.allclose(stable.max(-1).values, bound)
    # where exp(-phi) overflows the stable form stays exact; -inf (filtered tokens) stays -inf
    extreme = torch.tensor([[-800.0, -790.5, float("-inf")]])
    result = truncated_gumbel(extreme, torch.tensor([-5.0]))
    assert torch.allclose(result[0, :2], torch.tensor([-800.0, -5.0]))
    assert result[0, 2] == float("-inf")


def test_stochastic_beam_top_sequence_follows_the_sequence_probability():
    """The first sequence of a stochastic beam is a draw from p(x1, x2) (Gumbel-max over sequences)."""
    gen = torch.Generator().manual_seed(5)
    vocab = 4
    p1 = random_distribution(vocab, gen)
    p2 = torch.stack([random_distribution(vocab, gen) for _ in range(vocab)])
    n = 4000
    counts = torch.zeros(vocab, vocab)
    for _ in range(n):
        rows, first, sums, gamma = stochastic_beam_step(
            p1.log().view(1, -1), torch.zeros(1), torch.zeros(1), 3, gen
        )
        rows, second, _, _ = stochastic_beam_step(p2[first].log(), sums, gamma, 3, gen)
        counts[first[rows[0]], second[0]] += 1
    assert chi_square_pvalue(counts, p1.view(-1, 1) * p2 * n) > P_VALUE_THRESHOLD


def test_stochastic_beam_siblings_are_drawn_without_replacement():
    """Seed 002 Thm 3.2, the property the exact tree tests assume for RSD-S: the children of one beam
    node, in order, are a draw without replacement from p(.|node), whatever their number (here the
    first two children of the likeliest first-level node, among the beams that give it two)."""
    gen = torch.Generator().manual_seed(6)
    vocab = 4
    p1 = random_distribution(vocab, gen)
    p2 = torch.stack([random_distribution(vocab, gen) for _ in range(vocab)])
    node = int(p1.argmax())
    pairs = torch.zeros(vocab, vocab)
    for _ in range(6000):
        _, level1, sums, gamma = stochastic_beam_step(
            p1.log().view(1, -1), torch.zeros(1), torch.zeros(1), 3, gen
        )
        rows, level2, _, _ = stochastic_beam_step(p2[level1].log(), sums, gamma, 3, gen)
        kids = [token for row, token in zip(rows, level2) if level1[row] == node]
        if len(kids) >= 2:
            pairs[kids[0], kids[1]] += 1
    q = p2[node]
    expected = q.view(-1, 1) * q.view(1, -1) / (1 - q.view(-1, 1))
    expected.fill_diagonal_(0)
    assert pairs.sum() > 1000
    assert chi_square_pvalue(pairs, expected * pairs.sum()) > P_VALUE_THRESHOLD


def test_chi_square_helper_rejects_a_wrong_distribution():
    """The test statistic has power: counts from q do not pass as counts from another distribution."""
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    counts = torch.bincount(torch.multinomial(q, 5000, replacement=True, generator=gen), minlength=4).float()
    assert chi_square_pvalue(counts, q * 5000) > P_VALUE_THRESHOLD
    assert chi_square_pvalue(counts, torch.full((4,), 1250.0)) < 1e-6
    # an outcome of probability zero is a failure whatever the other counts, even beside small cells
    assert chi_square_pvalue(torch.tensor([99.0, 1.0]), torch.tensor([100.0, 0.0])) == 0.0
    assert chi_square_pvalue(torch.tensor([97.0, 1.0, 2.0, 0.0]), torch.tensor([97.0, 0.0, 2.0, 1.0])) == 0.0
    # cells expected 0 and never seen add nothing; small ones are pooled, with the smallest others if needed
    counts = torch.tensor([40.0, 30.0, 2.0, 1.0, 0.0])
    assert chi_square_pvalue(counts, torch.tensor([40.0, 30.0, 2.0, 1.0, 0.0])) == 1.0
    assert chi_square_pvalue(counts, torch.tensor([41.0, 28.5, 1.5, 2.0, 0.0])) > 0.5
    assert chi_square_pvalue(torch.tensor([50.0, 40.0, 6.0, 4.0]), torch.tensor([52.0, 40.0, 5.0, 3.0])) > 0.5
