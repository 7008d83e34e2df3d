"""The engine on a CUDA device: greedy losslessness and sampling run there too (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.assisted import assisted
from polydraft.decoding.control import BetaTS, FixedK
from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.rsd import recursive_speculative
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import speculative
from polydraft.decoding.tree import TreeShape
from tests.decoding_helpers import tiny_pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
VOCAB = 96


def test_decoders_on_cuda():
    target, drafters = tiny_pair(VOCAB)
    target, drafter = target.cuda(), drafters["noisy"].cuda()
    target_lm, drafter_lm = CachedLM(target), CachedLM(drafter)
    device = torch.device("cuda")
    for seed in range(3):
        prompt = torch.randint(0, VOCAB, (5 + seed,), generator=torch.Generator().manual_seed(seed))
        reference = autoregressive(target_lm, prompt, 24, Sampling(), torch.Generator(device), set())
        outputs = [
            speculative(
                target_lm, drafter_lm, prompt, 24, Sampling(), FixedK(4), torch.Generator(device), set()
            ),
            speculative(
                target_lm,
                drafter_lm,
                prompt,
                24,
                Sampling(),
                BetaTS(1, 1, 6, 0),
                torch.Generator(device),
                set(),
            ),
            recursive_speculative(
                target_lm,
                drafter_lm,
                prompt,
                24,
                Sampling(),
                TreeShape.constant([2, 2, 1]),
                torch.Generator(device),
                set(),
            ),  # fmt: skip
            recursive_speculative(
                target_lm,
                drafter_lm,
                prompt,
                24,
                Sampling(),
                TreeShape.beam(3, 3),
                torch.Generator(device),
                set(),
            ),  # fmt: skip
            assisted(target, drafter, prompt, 24, Sampling(), 4, 0.0, 0, set()),
        ]
        for output in outputs:
            assert output.tokens == reference.tokens
            assert output.target_seconds > 0 and output.wall_seconds >= output.target_seconds
    sampling = Sampling(temperature=1.0, top_p=0.9)
    for run in (
        lambda g: speculative(target_lm, drafter_lm, prompt, 24, sampling, FixedK(4), g, set()),
        lambda g: recursive_speculative(
            target_lm, drafter_lm, prompt, 24, sampling, TreeShape.beam(3, 3), g, set()
        ),
    ):
        first = run(torch.Generator(device).manual_seed(1))
        again = run(torch.Generator(device).manual_seed(1))
        assert len(first.tokens) == 24 and first.tokens == again.tokens  # seeded: reproducible
