"""The rejection samplers recover the target distribution exactly (tests/exact_sampling.py integrates).

For random draft and target distributions that depend on the tokens before them, with zeros from top-k
and top-p truncation, the probability of every outcome (accepted draft tokens plus the next token,
including the token after a fully accepted draft) is computed by integrating over the draft tokens,
the uniforms and the final draw, and continued with the target to a fixed length; the result must be
the target's joint law, sequence by sequence, to 1e-6 (float64 throughout). No sampling: a wrong
variant cannot pass by luck.
"""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.sampling import gumbel_topk, probabilities
from tests.decoding_helpers import single_thread_fixture
from tests.exact_blockwise import check_blockwise, check_rescored_tree
from tests.exact_sampling import (
    BEAMS,
    BRANCHING,
    PAIRS,
    TOP_K,
    check_chain,
    check_rejection,
    check_tree,
)

single_thread = single_thread_fixture()


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_verify_chain_is_exact(monkeypatch, k, pair):
    check_chain(monkeypatch, k, pair)


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("children", [1, 2, 3, 4, "stop"])
def test_recursive_rejection_is_exact(monkeypatch, children, pair):
    check_rejection(monkeypatch, children, pair)


@pytest.mark.parametrize("pair", ["top-k", "top-p", "mixed"])
@pytest.mark.parametrize("shape", list(BRANCHING) + list(BEAMS))
def test_verify_tree_is_exact(monkeypatch, shape, pair):
    check_tree(monkeypatch, shape, pair)


def test_gumbel_top_k_takes_the_top_k_of_the_perturbed_log_probabilities(monkeypatch):
    """With the noise supplied, the children are the k largest of log p + g, in decreasing order, and the
    draws past the support are marked invalid: the Gumbel-top-k trick that makes them a draw without
    replacement in order (the noise itself: test_decoding_sampling.py)."""
    import polydraft.decoding.sampling as sampling_module

    log_p = probabilities(torch.randn(5, 6, generator=torch.Generator().manual_seed(0)), TOP_K).log()
    noise = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(sampling_module, "gumbel", lambda shape, generator, device: noise)
    tokens, valid = gumbel_topk(log_p, 4, torch.Generator())
    order = torch.argsort(log_p + noise, dim=-1, descending=True)[:, :4]
    assert valid.sum(1).tolist() == [3] * 5  # top-k=3 leaves 3 tokens per row: the 4th draw is invalid
    assert torch.equal(valid, (log_p + noise).gather(1, order) > float("-inf"))
    assert torch.equal(tokens[valid], order[valid])


@pytest.mark.parametrize("sampling", ["T0.7-topk2", "T1-topp0.8"])
@pytest.mark.parametrize("method", ["bpd", "medusa", "bpd+rescore"])
def test_blockwise_decoders_are_exact(monkeypatch, method, sampling):
    """The real `bpd`, `medusa` and `bpd+rescore` decoders, every draw integrated (tests/exact_blockwise.py)."""
    check_blockwise(monkeypatch, method, sampling)


@pytest.mark.parametrize("pair", ["top-k", "top-p", "mixed"])
def test_rescored_tree_verification_is_exact(monkeypatch, pair):
    """`medusa+rescore`: a tree drawn from `rescorer`'s lattice rows, verified by `verify_tree`."""
    check_rescored_tree(monkeypatch, pair)
