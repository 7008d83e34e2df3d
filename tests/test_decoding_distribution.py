"""Through the full decoders, sampled outputs follow the target's distribution (tiny vocabulary models).

The exact distribution of the first two generated tokens, q(a) q(b | a), is computed with plain
forward passes of the target; each decoder then samples many outputs with a fixed seed and a
chi-square test with the threshold fixed in advance (p > 1e-3, no retries) compares them. Three new
tokens are generated so that the first round can draft two levels deep.
"""

from __future__ import annotations

import pytest
import torch

from decoding.control import BetaTS, FixedK
from decoding.engine import autoregressive
from decoding.lm import CachedLM
from decoding.rsd import recursive_speculative
from decoding.sampling import Sampling, probabilities
from decoding.sd import speculative
from decoding.tree import TreeShape
from models.tiny import build_llama
from tests.decoding_helpers import P_VALUE_THRESHOLD, chi_square_pvalue, single_thread_fixture, spread

single_thread = single_thread_fixture()
VOCAB = 6
SAMPLES = 1500
PROMPT = torch.tensor([1, 4, 5, 0])


@pytest.fixture(scope="module")
def models():
    target = spread(build_llama(VOCAB, 16, 2, 2, 32, seed=0), 0.6, 0)
    drafter = spread(build_llama(VOCAB, 16, 1, 2, 32, seed=1), 0.6, 1)
    return target, drafter


def exact_pairs(target, sampling: Sampling) -> torch.Tensor:
    with torch.inference_mode():
        first = probabilities(target(PROMPT.view(1, -1)).logits[0, -1], sampling)
        rows = torch.stack([torch.cat([PROMPT, torch.tensor([a])]) for a in range(VOCAB)])
        second = probabilities(target(rows).logits[:, -1], sampling)
    return first.view(-1, 1) * second


DECODERS = {
    "ar": lambda t, d, s, g: autoregressive(t, PROMPT, 3, s, g, set()),
    "sd": lambda t, d, s, g: speculative(t, d, PROMPT, 3, s, FixedK(2), g, set()),
    "sd-beta-ts": lambda t, d, s, g: speculative(t, d, PROMPT, 3, s, BetaTS(2.0, 1.0, 2, 0), g, set()),
    "rsd_c": lambda t, d, s, g: recursive_speculative(
        t, d, PROMPT, 3, s, TreeShape.constant([2, 2]), g, set()
    ),
    "rsd_s": lambda t, d, s, g: recursive_speculative(t, d, PROMPT, 3, s, TreeShape.beam(3, 2), g, set()),
}


@pytest.mark.parametrize(
    ("decoder", "sampling"),
    [
        ("ar", Sampling(temperature=1.0)),
        ("sd", Sampling(temperature=1.0)),
        ("sd-beta-ts", Sampling(temperature=0.8, top_p=0.9)),
        ("rsd_c", Sampling(temperature=1.0)),
        ("rsd_s", Sampling(temperature=1.0, top_p=0.95)),
    ],
)
def test_decoder_samples_follow_the_target(models, decoder, sampling):
    target_model, drafter_model = models
    target, drafter = CachedLM(target_model), CachedLM(drafter_model)
    generator = torch.Generator().manual_seed(11)
    counts = torch.zeros(VOCAB, VOCAB)
    speculated = 0
    for _ in range(SAMPLES):
        gen = DECODERS[decoder](target, drafter, sampling, generator)
        counts[gen.tokens[0], gen.tokens[1]] += 1
        speculated += sum(r.accepted for r in gen.rounds)
    if decoder != "ar":
        assert speculated > SAMPLES // 4  # drafts were really accepted along the way
    assert chi_square_pvalue(counts, exact_pairs(target_model, sampling) * SAMPLES) > P_VALUE_THRESHOLD
