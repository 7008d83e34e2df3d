"""The samplers recover the target distribution exactly: chi-square tests on small vocabularies with known p and q.

Each test draws with a fixed seed and passes when the p-value exceeds `P_VALUE_THRESHOLD` (1e-3), fixed
in advance; nothing is retried.
"""

from __future__ import annotations

import pytest
import torch

from decoding.sampling import (
    Sampling,
    gumbel_topk,
    probabilities,
    recursive_rejection,
    stochastic_beam_step,
    truncated_gumbel,
    verify_chain,
)
from decoding.tree import Tree, verify_tree
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


@pytest.mark.parametrize("k", [1, 2, 3])
def test_verify_chain_outputs_follow_the_target(k):
    gen = torch.Generator().manual_seed(k)
    p = torch.stack([random_distribution(V, gen, zeros=1) for _ in range(k)])
    q = torch.stack([random_distribution(V, gen, zeros=i % 2) for i in range(k + 1)])
    n = 6000
    first = torch.zeros(V)
    second = torch.zeros(V)
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(p[i], 1, generator=gen)[0] for i in range(k)])
        accepted, token = verify_chain(drafts, p, q, gen)
        produced = torch.cat([drafts[:accepted], token]).tolist()
        first[produced[0]] += 1
        if len(produced) > 1:
            second[produced[1]] += 1
    assert chi_square_pvalue(first, q[0] * n) > P_VALUE_THRESHOLD
    if k > 1:
        assert second.sum() > 500
        assert chi_square_pvalue(second, q[1] * second.sum()) > P_VALUE_THRESHOLD


@pytest.mark.parametrize(("k", "draft_zeros"), [(1, 0), (2, 0), (3, 2), (5, 3)])
def test_recursive_rejection_with_gumbel_top_k_draws_follows_the_target(k, draft_zeros):
    gen = torch.Generator().manual_seed(10 + k)
    p = random_distribution(V, gen, zeros=draft_zeros)
    q = random_distribution(V, gen, zeros=1)
    n = 6000
    counts = torch.zeros(V)
    for _ in range(n):
        tokens, valid = gumbel_topk(p.log().view(1, -1), k, gen)
        children = tokens[0][valid[0]].tolist()
        # drafts without replacement never repeat and never have probability zero
        assert len(set(children)) == len(children) and all(p[c] > 0 for c in children)
        _, token = recursive_rejection(children, p, q, gen)
        counts[token] += 1
    assert chi_square_pvalue(counts, q * n) > P_VALUE_THRESHOLD


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


def two_level_tree(method: str, p1, p2, gen) -> tuple[Tree, torch.Tensor]:
    """A depth-2 draft tree over context-free toy distributions; returns it and the drafter's rows."""
    if method == "rsd_c":
        tokens, valid = gumbel_topk(p1.log().view(1, -1), 2, gen)
        level1 = tokens[0][valid[0]]
        tokens, valid = gumbel_topk(p2[level1].log(), 2, gen)
        level2 = tokens.view(-1)[valid.view(-1)]
        parents2 = torch.arange(level1.numel()).repeat_interleave(2)[valid.view(-1)]
    else:
        _, level1, sums, gamma = stochastic_beam_step(
            p1.log().view(1, -1), torch.zeros(1), torch.zeros(1), 3, gen
        )
        parents2, level2, _, _ = stochastic_beam_step(p2[level1].log(), sums, gamma, 3, gen)
    n1 = level1.numel()
    tree = Tree(
        tokens=level1.tolist() + level2.tolist(),
        parents=[-1] * n1 + parents2.tolist(),
        depths=[1] * n1 + [2] * level2.numel(),
        fed=n1,
    )
    return tree, torch.cat([p1.view(1, -1), p2[level1]])


@pytest.mark.parametrize("method", ["rsd_c", "rsd_s"])
def test_tree_verification_recovers_the_target_over_two_levels(method):
    """Recursive rejection sampling level by level on RSD-C and RSD-S trees: the first token follows
    q1 and, given it, the second follows q2(.|x1), including residual and no-child cases."""
    gen = torch.Generator().manual_seed(7 if method == "rsd_c" else 8)
    vocab = 5
    p1 = random_distribution(vocab, gen, zeros=1)
    p2 = torch.stack([random_distribution(vocab, gen, zeros=1) for _ in range(vocab)])
    q1 = random_distribution(vocab, gen)
    q2 = torch.stack([random_distribution(vocab, gen) for _ in range(vocab)])
    n = 5000
    first = torch.zeros(vocab)
    pairs = torch.zeros(vocab, vocab)
    for _ in range(n):
        tree, draft_rows = two_level_tree(method, p1, p2, gen)
        # target rows: root, then each node's distribution of the next token (context-free toy)
        target_rows = torch.cat([q1.view(1, -1), q2[torch.tensor(tree.tokens)]])
        path, token = verify_tree(tree, draft_rows, target_rows, False, gen)
        produced = [tree.tokens[i] for i in path] + [token]
        first[produced[0]] += 1
        if len(produced) > 1:
            pairs[produced[0], produced[1]] += 1
    assert chi_square_pvalue(first, q1 * n) > P_VALUE_THRESHOLD
    expected = pairs.sum(1, keepdim=True) * q2
    used = int((pairs.sum(1) > 0).sum())
    assert pairs.sum() > 1000
    assert chi_square_pvalue(pairs, expected, groups=used) > P_VALUE_THRESHOLD


def test_chi_square_helper_rejects_a_wrong_distribution():
    """The test statistic has power: counts from q do not pass as counts from another distribution."""
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    counts = torch.bincount(torch.multinomial(q, 5000, replacement=True, generator=gen), minlength=4).float()
    assert chi_square_pvalue(counts, q * 5000) > P_VALUE_THRESHOLD
    assert chi_square_pvalue(counts, torch.full((4,), 1250.0)) < 1e-6
    # an outcome of probability zero is a failure whatever the other counts
    assert chi_square_pvalue(torch.tensor([99.0, 1.0]), torch.tensor([100.0, 0.0])) == 0.0
