"""Every sampling decoder x control x temperature x truncation on table models (tests/table_lm.py).

The blockwise decoders (`bpd`, `medusa` and their `+rescore` variants) draft from K proposal heads on the
table target's hidden states (`HEADS`, random weights: they agree with the target only by chance), the
rescoring drafter being the table drafter.

`check(name)` decodes LENGTH = K + 2 tokens many times with one configuration and tests the joint law
of ALL of them against the target's exact law (tests/distribution_harness.py), so the token after a
fully accepted draft (or a fully accepted tree path) is in every test. Vocabulary 3, so the joint law
has at most 81 outputs; top-k 2 and top-p 0.8 give outputs of probability zero, which fail at once.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from polydraft.decoding.blockwise import HeadsDraft, Rescoring, blockwise_chain, blockwise_tree
from polydraft.decoding.control import BetaTS, CaliTS, FixedK
from polydraft.decoding.eagle3 import eagle3_decode
from polydraft.decoding.eesd import self_speculative
from polydraft.decoding.lattice import CandidateTree
from polydraft.decoding.rsd import recursive_speculative
from polydraft.decoding.sampling import Sampling, probabilities
from polydraft.decoding.sd import speculative
from polydraft.decoding.tree import TreeShape
from polydraft.models.heads import Heads
from tests.distribution_harness import assert_follows, sample_size, target_joint
from tests.table_lm import HIDDEN, TableEagle3, TableFeatureLM, TableLM, TableModel, TableSelfSpeculative

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


def table_heads(seed: int = 5) -> Heads:
    """K Medusa heads on the table target's hidden states [HIDDEN], every weight drawn at random."""
    heads = Heads("medusa", K, HIDDEN, VOCAB)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 1.5)
    return heads.eval()


HEADS = table_heads()
MEDUSA_TREE = CandidateTree.from_paths([[0], [1], [0, 0]])
"""Depth 2; two children at the root (rank 0 and 1 of head 0), one below the first."""
RESCORE = {"weight": 0.5, "top_k": 2, "beam_width": 2}
"""Local rescoring over the heads' top 2 (of 3) tokens, 2 beams (bpd+rescore draws one path)."""
BLOCKWISE = ("bpd", "medusa", "bpd+rescore", "medusa+rescore")
# sd_greedy: vLLM's default drafting, argmax drafts with a one-hot draft distribution
METHODS = (
    [f"{d}-{c}" for d in ("sd", "eesd") for c in CONTROLS]
    + ["sd_greedy-fixed"]
    + [f"eagle3-{c}" for c in ("fixed", "beta_ts")]  # no calibration model for EAGLE-3 heads
    + list(TREES)
    + list(BLOCKWISE)
)
CONFIGS = [f"{m}:{s}" for m, s in itertools.product(METHODS, SAMPLINGS)]


def decoder(method: str, sampling: Sampling, generator: torch.Generator):
    """decode() -> `Generation` of one output, for one method on the table models."""
    prompt = torch.tensor(PROMPT)
    if method in BLOCKWISE:
        return blockwise_decoder(method, sampling, generator)
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
    if kind == "eagle3":
        target, head = TableFeatureLM(TARGET), TableEagle3(DRAFTER)
        return lambda: eagle3_decode(target, head, prompt, LENGTH, sampling, control, generator, set())
    model = TableSelfSpeculative(TARGET, DRAFTER)
    return lambda: self_speculative(model, prompt, LENGTH, sampling, control, generator, set())


def blockwise_decoder(method: str, sampling: Sampling, generator: torch.Generator):
    """decode() for `bpd`, `medusa`, `bpd+rescore` or `medusa+rescore` with `HEADS` on the table target."""
    prompt, target = torch.tensor(PROMPT), TableLM(TARGET)
    heads = HeadsDraft(HEADS, target, profile=False)
    rescoring = None
    if method.endswith("+rescore"):
        rescoring = Rescoring(TableLM(DRAFTER), **RESCORE)
    if method.startswith("bpd"):
        return lambda: blockwise_chain(target, heads, prompt, LENGTH, sampling, generator, set(), rescoring)
    shape = MEDUSA_TREE if rescoring is None else None
    return lambda: blockwise_tree(target, heads, prompt, LENGTH, sampling, generator, set(), shape, rescoring)


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


GREEDY_PROMPTS = [[0, 1], [2], [1, 1, 0, 2], [2, 0], [0]]


def check_greedy(method: str, new_tokens: int = 12) -> None:
    """At temperature 0 a decoder's output is the table target's greedy output (blockwise decoders)."""
    from polydraft.decoding.engine import autoregressive

    greedy, generator, target = Sampling(), torch.Generator(), TableLM(TARGET)
    accepted = 0
    for tokens in GREEDY_PROMPTS:
        prompt = torch.tensor(tokens)
        expected = autoregressive(target, prompt, new_tokens, greedy, generator, set()).tokens
        heads = HeadsDraft(HEADS, target, profile=False)
        rescoring = Rescoring(TableLM(DRAFTER), **RESCORE) if method.endswith("+rescore") else None
        if method.startswith("bpd"):
            got = blockwise_chain(target, heads, prompt, new_tokens, greedy, generator, set(), rescoring)
        else:
            shape = MEDUSA_TREE if rescoring is None else None
            got = blockwise_tree(
                target, heads, prompt, new_tokens, greedy, generator, set(), shape, rescoring
            )
        assert got.tokens == expected, (method, tokens, got.tokens, expected)
        accepted += sum(min(r.accepted, 2) == 2 for r in got.rounds)
    assert accepted > 0, f"{method}: no round accepted two drafts, the second level was never checked"
