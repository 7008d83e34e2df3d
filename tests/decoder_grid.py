"""Every sampling decoder x control x temperature x truncation on table models (tests/table_lm.py).

`check(name)` decodes LENGTH = K + 2 tokens many times with one configuration and tests the joint law
of ALL of them against the target's exact law (tests/distribution_harness.py), so the token after a
fully accepted draft (or a fully accepted tree path) is in every test. Vocabulary 3, so the joint law
has at most 81 outputs; top-k 2 and top-p 0.8 give outputs of probability zero, which fail at once.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from decoding.control import BetaTS, CaliTS, FixedK
from decoding.eesd import self_speculative
from decoding.rsd import recursive_speculative
from decoding.sampling import Sampling, probabilities
from decoding.sd import speculative
from decoding.tree import TreeShape
from tests.distribution_harness import assert_follows, sample_size, target_joint
from tests.table_lm import TableLM, TableModel, TableSelfSpeculative

VOCAB = 3
K = 2
LENGTH = K + 2
PROMPT = [0, 1]
TV = 0.1
"""The minimum total variation every configuration detects with power >= 0.99 (false alarms <= 1e-3)."""
TARGET = TableModel(VOCAB, seed=0)
DRAFTER = TableModel(VOCAB, seed=1, base=TARGET, noise=0.7)

CONTROLS = {
    "fixed": lambda seed: FixedK(K),
    "beta_ts": lambda seed: BetaTS(1.0, 1.0, K, seed),
    # a calibration model that reads both hidden states, so the draft length varies with the context
    "cali_ts": lambda seed: CaliTS(
        0.2, 0.3, 0.5, lambda i, t, d: float(0.2 + 0.4 * t[0] + 0.4 * d[1]), K, seed
    ),
}
TREES = {"rsd_c": TreeShape.constant([2, 1]), "rsd_s": TreeShape.beam(3, 2)}
"""Depth 2. Not b = (2, 2): with top-k 2 two children cover the support and are never all rejected."""
SAMPLINGS = {
    "T0.7-topk2": Sampling(0.7, top_k=2),
    "T1-topk2": Sampling(1.0, top_k=2),
    "T0.7-topp0.8": Sampling(0.7, top_p=0.8),
    "T1-topp0.8": Sampling(1.0, top_p=0.8),
}
# sd_greedy: vLLM's default drafting, argmax drafts with a one-hot draft distribution
METHODS = [f"{d}-{c}" for d in ("sd", "eesd") for c in CONTROLS] + ["sd_greedy-fixed"] + list(TREES)
CONFIGS = [f"{m}:{s}" for m, s in itertools.product(METHODS, SAMPLINGS)]


def decoder(method: str, sampling: Sampling, generator: torch.Generator):
    """decode() -> `Generation` of one output, for one method on the table models."""
    prompt = torch.tensor(PROMPT)
    kind, _, control_name = method.partition("-")
    if kind in TREES:
        target, drafter = TableLM(TARGET), TableLM(DRAFTER)
        shape = TREES[kind]
        return lambda: recursive_speculative(
            target, drafter, prompt, LENGTH, sampling, shape, generator, set()
        )
    control = CONTROLS[control_name](seed=len(method))
    if kind in ("sd", "sd_greedy"):
        target, drafter, greedy = TableLM(TARGET), TableLM(DRAFTER), kind == "sd_greedy"
        return lambda: speculative(
            target, drafter, prompt, LENGTH, sampling, control, generator, set(), greedy_drafts=greedy
        )
    model = TableSelfSpeculative(TARGET, DRAFTER)
    return lambda: self_speculative(model, prompt, LENGTH, sampling, control, generator, set())


def exact_law(sampling: Sampling) -> dict[tuple[int, ...], float]:
    return target_joint(lambda tokens: probabilities(TARGET.logits(PROMPT + list(tokens)), sampling), LENGTH)


def check(config: str, seed: int = 0) -> int:
    """Run the test of one configuration; returns the sample size it used."""
    method, _, sampling_name = config.partition(":")
    sampling = SAMPLINGS[sampling_name]
    law = exact_law(sampling)
    samples = sample_size(law, TV)
    generate = decoder(method, sampling, torch.Generator().manual_seed(seed))
    rounds = Counter()

    def decode() -> list[int]:
        gen = generate()
        for r in gen.rounds:
            if r.draft_length:
                rounds["full" if r.accepted == r.draft_length else "rejected"] += 1
        return gen.tokens

    assert_follows(decode, law, samples)
    # the test saw drafts rejected and drafts accepted to the end (then the next token is the bonus one)
    assert min(rounds["full"], rounds["rejected"]) > samples // 10, rounds
    return samples
