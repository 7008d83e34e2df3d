"""Through the full decoders, sampled outputs follow the target's joint law, with stated power.

Every decoder x control (`sd` and `eesd` with fixed K, Beta-TS and Cali-TS; `sd` with argmax drafts;
`rsd_c`, `rsd_s`; the blockwise `bpd`, `medusa`, `bpd+rescore` and `medusa+rescore` with K = 2 heads) x
temperature {0.7, 1} x {top-k 2, top-p 0.8} decodes K + 2 = 4 tokens (K = 2, tree depth 2) on table
models (tests/table_lm.py, vocabulary 3) and the joint law of all 4 tokens is tested against the
exact law (tests/decoder_grid.py, tests/distribution_harness.py): false-alarm rate 1e-3, power >= 0.99
against ANY law at total variation >= 0.1, an output of probability zero fails at once.

| truncation | N | outputs of probability > 0 | test cells (pooled mass) | power at TV 0.1 |
| --- | --- | --- | --- | --- |
| T 0.7, top-k 2 | 2091 | 16 | 14 (0.018) | >= 0.99 |
| T 1, top-k 2 | 1746 | 16 | 15 (0.0092) | >= 0.99 |
| T 0.7, top-p 0.8 | 1548 | 18 | 18 (0) | >= 0.99 |
| T 1, top-p 0.8 | 1781 | 29 | 29 (0) | >= 0.99 |

The same N for every decoder (the target's law depends on the truncation only); 52 configurations, about 45 s
on 2 cores (the 16 blockwise ones 0.7-1.8 s each). `test_stated_sample_sizes` recomputes the table.
"""

from __future__ import annotations

import pytest
import torch

from tests import decoder_grid
from tests.decoding_helpers import single_thread_fixture
from tests.distribution_harness import POWER, assert_follows, cells, power, sample_size

single_thread = single_thread_fixture()
STATED = {
    "T0.7-topk2": (2091, 14),
    "T1-topk2": (1746, 15),
    "T0.7-topp0.8": (1548, 18),
    "T1-topp0.8": (1781, 29),
}


@pytest.mark.parametrize("config", decoder_grid.CONFIGS)
def test_decoder_samples_follow_the_target(config):
    decoder_grid.check(config)


def test_stated_sample_sizes():
    for name, (samples, groups) in STATED.items():
        law = decoder_grid.exact_law(decoder_grid.SAMPLINGS[name])
        assert sample_size(law, decoder_grid.TV) == samples
        assert len(cells(law, samples)[0]) == groups
        assert power(law, samples, decoder_grid.TV) >= POWER


def draws(law: dict, probs: list[float], seed: int):
    """decode() drawing outputs of `law`'s support with probabilities `probs`."""
    outcomes = list(law)
    generator = torch.Generator().manual_seed(seed)
    weights = torch.tensor(probs, dtype=torch.float64)
    return lambda: outcomes[int(torch.multinomial(weights, 1, generator=generator))]


def test_harness_rejects_a_law_at_the_stated_distance():
    """A law at total variation TV (0.1) from the target (mass moved from the likeliest output to the least
    likely ones) fails; the target itself passes."""
    law = decoder_grid.exact_law(decoder_grid.SAMPLINGS["T1-topk2"])
    samples = sample_size(law, decoder_grid.TV)
    exact = list(law.values())
    assert_follows(draws(law, exact, 0), law, samples)
    moved = list(exact)
    top = max(range(len(moved)), key=moved.__getitem__)
    moved[top] -= decoder_grid.TV
    smallest = sorted(range(len(moved)), key=moved.__getitem__)[:4]
    for index in smallest:
        moved[index] += decoder_grid.TV / 4
    with pytest.raises(AssertionError, match="Pearson"):
        assert_follows(draws(law, moved, 1), law, samples)


def test_harness_fails_at_once_on_an_output_of_probability_zero():
    law = {(0, 0): 0.5, (0, 1): 0.5}
    outputs = iter([(0, 0), (1, 1)])
    with pytest.raises(AssertionError, match=r"\(1, 1\) has probability zero"):
        assert_follows(lambda: next(outputs), law, 1000)
