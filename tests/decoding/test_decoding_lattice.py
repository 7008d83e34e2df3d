"""The drafter-rescored lattice and Medusa candidate trees against brute force on small lattices.

Brute force scores every path through a k-candidate lattice with plain (uncached, unmasked) forwards of
the drafter on prompt + path prefix; the beam search runs through `draft_tree` with the drafter's KV
cache and tree attention. Sampling: one path drawn by stochastic beam search of width 1 against the
brute-force law of the paths (chi-square, threshold fixed in advance, 2000 samples over 27 paths).
"""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.lattice import (
    CandidateTree,
    best_path,
    candidate_tree,
    drafter_log_probs,
    head_log_probs,
    rescorer,
)
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.tree import Tree, TreeShape, draft_tree
from polydraft.models.tiny import build_llama
from tests.decoding_helpers import P_VALUE_THRESHOLD, chi_square_pvalue, single_thread_fixture, spread

single_thread = single_thread_fixture()
VOCAB, DEPTH, TOP_K, WEIGHT = 12, 3, 3, 0.6
PROMPT = torch.tensor([3, 7, 1, 5])


@pytest.fixture(scope="module")
def lattice():
    drafter = spread(build_llama(VOCAB, 16, 1, 2, 32, seed=4), 0.5, 4)
    heads = torch.log_softmax(torch.randn(DEPTH, VOCAB, generator=torch.Generator().manual_seed(2)) * 2, -1)
    return drafter, heads


def brute_force(
    drafter, head_logp, sampling: Sampling, weight: float = WEIGHT
) -> dict[tuple[int, ...], float]:
    """Every path and prefix through the lattice -> sum_j log r_j(y_j | y_<j), from plain forwards."""
    candidates = head_logp.topk(TOP_K, dim=-1).indices
    scores: dict[tuple[int, ...], float] = {(): 0.0}
    with torch.inference_mode():
        for level in range(DEPTH):
            for prefix in [p for p in scores if len(p) == level]:
                ids = torch.cat([PROMPT, torch.tensor(prefix, dtype=torch.long)]).view(1, -1)
                d = drafter_log_probs(drafter(ids).logits[0, -1], sampling)
                c = candidates[level]
                r = torch.log_softmax((1 - weight) * head_logp[level, c] + weight * d[c], -1)
                for token, log_r in zip(c.tolist(), r.tolist()):
                    scores[(*prefix, token)] = scores[prefix] + log_r
    return scores


def paths_of(tree: Tree, level: int) -> list[tuple[int, ...]]:
    """The token path of every node at depth `level`, in node order."""
    out = []
    for node, depth in enumerate(tree.depths):
        if depth == level:
            path, walk = [], node
            while walk >= 0:
                path.append(tree.tokens[walk])
                walk = tree.parents[walk]
            out.append(tuple(path[::-1]))
    return out


@torch.inference_mode()
def search(drafter_model, head_logp, width: int, sampling: Sampling, generator=None, weight: float = WEIGHT):
    drafter = CachedLM(drafter_model)
    rescore = rescorer(head_logp, TOP_K, weight, sampling)
    return draft_tree(
        drafter,
        PROMPT.view(1, -1),
        TreeShape.beam(width, DEPTH),
        DEPTH,
        sampling,
        generator or torch.Generator(),
        rescore,
    )


@pytest.mark.parametrize("width", [1, 2, 4, TOP_K ** (DEPTH - 1)])
def test_beam_search_is_brute_force_beam_search(lattice, width):
    drafter, heads = lattice
    scores = brute_force(drafter, heads, Sampling())
    tree, _ = search(drafter, heads, width, Sampling())
    # the brute-force beam search: each level keeps the `width` best extensions of the kept prefixes
    beams = [()]
    for level in range(1, DEPTH + 1):
        extended = [p for p in scores if len(p) == level and p[:-1] in beams]
        beams = sorted(extended, key=lambda p: -scores[p])[:width]
        assert paths_of(tree, level) == beams, level
    if width == TOP_K ** (DEPTH - 1):  # wide enough to be exact: the best path of all
        best = max((p for p in scores if len(p) == DEPTH), key=scores.get)
        assert tuple(tree.tokens[n] for n in best_path(tree)) == best


def test_lambda_zero_is_the_heads_argmax_chain(lattice):
    drafter, heads = lattice
    tree, _ = search(drafter, heads, 1, Sampling(), weight=0.0)
    assert [tree.tokens[n] for n in best_path(tree)] == heads.argmax(-1).tolist()


def test_sampled_paths_follow_the_rescored_law(lattice):
    drafter, heads = lattice
    sampling = Sampling(temperature=1.0)
    scores = brute_force(drafter, heads, sampling)
    paths = [p for p in scores if len(p) == DEPTH]
    law = torch.tensor([scores[p] for p in paths]).exp()
    assert float(law.sum()) == pytest.approx(1.0, abs=1e-5)
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(len(paths))
    samples = 2000
    for _ in range(samples):
        tree, dists = search(drafter, heads, 1, sampling, generator)
        path = best_path(tree)
        tokens = tuple(tree.tokens[n] for n in path)
        counts[paths.index(tokens)] += 1
        # the rows handed to verification: r_j(. | y_<j), whose product is the path's probability
        rows = dists[[0] + [n + 1 for n in path[:-1]]]
        prob = torch.prod(rows[torch.arange(DEPTH), torch.tensor(tokens)])
        assert float(prob.log()) == pytest.approx(scores[tokens], abs=1e-4)
    assert chi_square_pvalue(counts, law * samples) > P_VALUE_THRESHOLD


# ----------------------------------------------------------------------------- Medusa candidate trees


def test_candidate_tree_shapes_are_checked():
    assert CandidateTree.from_paths([[0, 0], [0], [1]]).paths == ((0,), (1,), (0, 0))
    assert CandidateTree.chain(3).paths == ((0,), (0, 0), (0, 0, 0))
    with pytest.raises(ValueError, match="no parent"):
        CandidateTree.from_paths([[0], [1, 0]])
    with pytest.raises(ValueError, match="rank 0 is missing"):
        CandidateTree.from_paths([[1]])


def test_candidate_tree_greedy_holds_the_ranked_tokens(lattice):
    _, heads = lattice
    shape = CandidateTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tree, dists = candidate_tree(heads, shape, DEPTH, Sampling(), torch.Generator())
    ranked = heads.topk(2, dim=-1).indices.tolist()
    assert dists is None
    assert tree.tokens == [ranked[0][0], ranked[0][1], ranked[1][0], ranked[1][1], ranked[1][0], ranked[2][0]]
    assert tree.parents == [-1, -1, 0, 0, 1, 2] and tree.depths == [1, 1, 2, 2, 2, 3]
    # depth-limited: only the first level
    tree, _ = candidate_tree(heads, shape, 1, Sampling(), torch.Generator())
    assert tree.tokens == ranked[0][:2]


def test_candidate_tree_sampling_draws_siblings_without_replacement(lattice):
    _, heads = lattice
    shape = CandidateTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 1]])
    sampling = Sampling(temperature=1.0, top_k=2)  # each head offers two tokens: rank 2 cannot exist
    logp = head_log_probs(heads, sampling)
    tree, dists = candidate_tree(logp, shape, 2, sampling, torch.Generator().manual_seed(0))
    assert tree.depths == [1, 1, 2, 2, 2, 2]
    children = tree.children()
    for kids in children.values():  # siblings are distinct: drawn without replacement
        assert sorted(tree.tokens[k] for k in kids) == sorted(
            heads[tree.depths[kids[0]] - 1].topk(2).indices.tolist()
        )
    # each parent's row is the head its children were drawn from
    assert torch.equal(dists[0], logp[0].exp())
    for node, depth in enumerate(tree.depths):
        if depth == 1:
            assert torch.equal(dists[node + 1], logp[1].exp())
