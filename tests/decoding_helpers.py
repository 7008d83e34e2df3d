"""Shared by the decoding tests: a chi-square test with a threshold fixed in advance, tiny model pairs."""

from __future__ import annotations

import copy

import pytest
import torch

from polydraft.models.tiny import build_llama

P_VALUE_THRESHOLD = 1e-3
"""Every distribution test uses a fixed seed and passes when its chi-square p-value exceeds this (no retries)."""


def single_thread_fixture():
    """A module-scoped autouse fixture running the module on one intra-op thread, then restoring.

    The decoding tests run thousands of tiny tensor ops; on a busy 2-core machine some of them (row
    reductions, softmax) split across threads and wait for a descheduled one, which makes them
    hundreds of times slower than on one thread. Assign the result to a module-level name.
    """

    @pytest.fixture(autouse=True, scope="module")
    def single_thread():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)

    return single_thread


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor, groups: int = 1) -> float:
    """Pearson's chi-square p-value of counts against expected counts (same shape, same total per group).

    An outcome of expected count 0 that was observed gives 0.0 at once: zero cells are never pooled.
    Cells expected fewer than 5 times (but more than 0) are pooled into one cell, with the smallest other
    cells while the pool is still expected fewer than 5 times, so that the chi-square approximation holds;
    `groups` is the number of independent multinomials (degrees of freedom = cells - groups).
    """
    observed, expected = observed.double().flatten(), expected.double().flatten()
    if bool((observed[expected == 0] > 0).any()):
        return 0.0
    observed, expected = observed[expected > 0], expected[expected > 0]
    order = torch.argsort(expected)
    observed, expected = observed[order], expected[order]
    pooled = int((expected < 5).sum())
    while 0 < pooled < expected.numel() and float(expected[:pooled].sum()) < 5:
        pooled += 1
    if pooled:
        observed = torch.cat([observed[:pooled].sum().view(1), observed[pooled:]])
        expected = torch.cat([expected[:pooled].sum().view(1), expected[pooled:]])
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = expected.numel() - groups
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), torch.tensor(statistic / 2))
    )


def random_distribution(vocab: int, generator: torch.Generator, zeros: int = 0) -> torch.Tensor:
    """A random probability vector with `zeros` entries of probability exactly zero."""
    weights = torch.rand(vocab, generator=generator, dtype=torch.double) + 0.05
    if zeros:
        weights[torch.randperm(vocab, generator=generator)[:zeros]] = 0
    return (weights / weights.sum()).float()


def spread(model: torch.nn.Module, std: float, seed: int) -> torch.nn.Module:
    """Redraw every weight matrix with a larger std than the init's 0.02.

    A freshly initialised tiny Llama is almost the identity: greedy decoding repeats the last token,
    which would make the losslessness tests trivial. Larger weights give varied outputs.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model


def tiny_pair(vocab: int, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """A 4-layer target and drafters that agree with it to different degrees.

    `copy`: the target itself (everything accepted); `noisy`: the target with its last layer perturbed
    (partly accepted); `small`: an unrelated 1-layer model of another width (mostly rejected).
    """
    target = build_llama(vocab, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128, seed=seed)
    spread(target, 0.2, seed)
    noisy = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for parameter in noisy.model.layers[-1].parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    small = build_llama(vocab, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed + 1)
    spread(small, 0.2, seed + 1)
    return target, {"copy": copy.deepcopy(target), "noisy": noisy, "small": small}
