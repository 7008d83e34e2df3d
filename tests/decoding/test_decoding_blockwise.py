"""`bpd`, `medusa` and their `+rescore` variants are lossless: `ar`'s output at temperature 0, the target's
distribution when sampling.

Greedy: heads fitted for a few steps to the target's own greedy continuations of the test prompts (so
drafts are accepted, partly), both head kinds, rescoring drafters that agree with the target fully,
partly and hardly, prompts of several lengths, length limits and an EOS met part-way.

Sampling (tiny vocabulary, as tests/decoding/test_decoding_distribution.py): 4 new tokens, so that the second
round drafts two levels from the heads' first hidden state; the exact law of tokens 2 and 3,
sum_a q(a) q(b | a) q(c | a, b), against 1500 samples by a chi-square test with the threshold fixed in
advance (p > 1e-3, fixed seed, no retries). Power: with the df of these tables (at most 35) the test
rejects with probability >= 0.9 any output law whose chi-square divergence sum (p1 - p0)^2 / p0 from the
exact one is >= 0.035, e.g. 4% of the mass moved between two cells of probability 0.05 (divergence
0.064); `test_stated_power` recomputes this. The verification steps themselves (`verify_chain`,
`verify_tree`) are also proved exactly by tests/decoding/test_decoding_exact.py; these tests cover what is new
here, how the drafts are drawn and which distributions are handed to verification.
"""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.blockwise import HeadsDraft, Rescoring, blockwise_chain, blockwise_tree
from polydraft.decoding.engine import Generation, autoregressive
from polydraft.decoding.lattice import CandidateTree
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling, probabilities, sample, verify_chain
from polydraft.models.heads import heads_for_target
from polydraft.models.tiny import build_llama
from tests.decoding_helpers import (
    P_VALUE_THRESHOLD,
    chi_square_pvalue,
    single_thread_fixture,
    spread,
    tiny_pair,
)
from tests.heads_setup import fit_heads

single_thread = single_thread_fixture()
GREEDY = Sampling()
VOCAB = 96
NUM_HEADS = 3
TREE = CandidateTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]])
CASES = [(1, 1), (1, 6), (3, 2), (8, 17), (15, 9), (5, 12)]
"""(prompt length, max_new_tokens)."""


@pytest.fixture(scope="module")
def greedy_setup():
    target_model, drafters = tiny_pair(VOCAB)
    target = CachedLM(target_model)
    prompts = torch.Generator().manual_seed(1)
    cases = [(torch.randint(0, VOCAB, (length,), generator=prompts), n) for length, n in CASES]
    sequences = [
        torch.cat([p, torch.tensor(autoregressive(target, p, 20, GREEDY, torch.Generator(), set()).tokens)])
        for p, _ in cases[::2]  # the other prompts' drafts are partly rejected
    ]
    heads = {
        kind: HeadsDraft(fit_heads(target_model, kind, NUM_HEADS, sequences, steps=10), target)
        for kind in ("medusa", "bpd")
    }
    return target, heads, {name: CachedLM(model) for name, model in drafters.items()}, cases


def check_record(gen: Generation) -> None:
    assert gen.target_calls == len(gen.rounds)
    assert sum(r.accepted + 1 for r in gen.rounds) >= len(gen.tokens) >= len(gen.rounds)
    assert all(r.accepted <= r.drafted for r in gen.rounds)


def greedy_decoders(target, heads, drafters) -> dict:
    """Variant -> decode(prompt, max_new_tokens, eos_ids)."""

    def chain(rescoring=None):
        return lambda p, n, e: blockwise_chain(target, heads, p, n, GREEDY, torch.Generator(), e, rescoring)

    def tree(shape=None, rescoring=None):
        return lambda p, n, e: blockwise_tree(
            target, heads, p, n, GREEDY, torch.Generator(), e, shape, rescoring
        )

    decoders = {"bpd": chain(), "medusa": tree(TREE)}
    for name, drafter in drafters.items():
        # lambda 0.5 over the top 3; lambda 1 over the whole vocabulary: the drafter's own greedy chain
        for weight, top_k, width in ((0.5, 3, 2), (1.0, VOCAB, 1)):
            rescoring = Rescoring(drafter, weight, top_k, width)
            decoders[f"bpd+rescore-{name}-{weight}"] = chain(rescoring)
            decoders[f"medusa+rescore-{name}-{weight}"] = tree(rescoring=rescoring)
    return decoders


@pytest.mark.parametrize("kind", ["medusa", "bpd"])
def test_greedy_output_is_ar_output(greedy_setup, kind):
    target, all_heads, drafters, cases = greedy_setup
    decoders = greedy_decoders(target, all_heads[kind], drafters)
    accepted = dict.fromkeys(decoders, 0)
    for prompt, max_new in cases:
        reference = autoregressive(target, prompt, max_new, GREEDY, torch.Generator(), set())
        eos = {reference.tokens[max_new // 2]}
        stopped = autoregressive(target, prompt, max_new, GREEDY, torch.Generator(), eos)
        for variant, decode in decoders.items():
            for expected, eos_ids in ((reference, set()), (stopped, eos)):
                got = decode(prompt, max_new, eos_ids)
                assert got.tokens == expected.tokens, (variant, len(prompt), max_new, eos_ids)
                assert got.stop == expected.stop
                check_record(got)
                accepted[variant] += sum(r.accepted for r in got.rounds)
    # drafts were accepted (the copy drafter's chain always) and rejected (the heads are only partly fitted)
    assert accepted["bpd"] > 0 and accepted["medusa"] > 0, accepted
    assert accepted["bpd+rescore-copy-1.0"] > accepted["bpd"], accepted


# ----------------------------------------------------------------------------- sampling

SMALL_VOCAB = 6
SAMPLES = 1500
PROMPT = torch.tensor([1, 4, 5, 0])


@pytest.fixture(scope="module")
def sampled_setup():
    target = spread(build_llama(SMALL_VOCAB, 16, 2, 2, 32, seed=0), 0.6, 0)
    drafter = spread(build_llama(SMALL_VOCAB, 16, 1, 2, 32, seed=1), 0.6, 1)
    heads = {}
    for seed, kind in enumerate(("medusa", "bpd")):
        model = heads_for_target(target, kind, 2)
        generator = torch.Generator().manual_seed(3 + seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        heads[kind] = model.eval()
    return target, drafter, heads


def exact_second_and_third(target, sampling: Sampling) -> torch.Tensor:
    """P(tokens[1] = b, tokens[2] = c) = sum_a q(a) q(b | a) q(c | a, b), by plain forwards."""
    v = SMALL_VOCAB
    with torch.inference_mode():
        first = probabilities(target(PROMPT.view(1, -1)).logits[0, -1], sampling)
        rows = torch.stack([torch.cat([PROMPT, torch.tensor([a])]) for a in range(v)])
        second = probabilities(target(rows).logits[:, -1], sampling)
        rows = torch.stack([torch.cat([PROMPT, torch.tensor([a, b])]) for a in range(v) for b in range(v)])
        third = probabilities(target(rows).logits[:, -1], sampling).view(v, v, v)
    return (first.view(v, 1, 1) * second.view(v, v, 1) * third).sum(0)


SAMPLED = {
    "bpd": ("medusa", Sampling(temperature=1.0), lambda t, h, d, s, g: blockwise_chain(t, h, PROMPT, 4, s, g, set())),
    "bpd-bpd-heads": (
        "bpd", Sampling(temperature=0.8, top_p=0.9), lambda t, h, d, s, g: blockwise_chain(t, h, PROMPT, 4, s, g, set())
    ),
    "bpd+rescore": (
        "bpd", Sampling(temperature=1.0),
        lambda t, h, d, s, g: blockwise_chain(t, h, PROMPT, 4, s, g, set(), Rescoring(d, 0.5, 3, 2)),
    ),
    "medusa": (
        "medusa", Sampling(temperature=0.8, top_p=0.9),
        lambda t, h, d, s, g: blockwise_tree(
            t, h, PROMPT, 4, s, g, set(), CandidateTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
        ),
    ),
    "medusa+rescore": (
        "medusa", Sampling(temperature=1.0, top_k=5),
        lambda t, h, d, s, g: blockwise_tree(t, h, PROMPT, 4, s, g, set(), rescoring=Rescoring(d, 0.5, 3, 2)),
    ),
}  # fmt: skip


@pytest.mark.parametrize("variant", list(SAMPLED))
def test_sampled_outputs_follow_the_target(sampled_setup, variant):
    target_model, drafter_model, heads_models = sampled_setup
    kind, sampling, decode = SAMPLED[variant]
    target, drafter = CachedLM(target_model), CachedLM(drafter_model)
    heads = HeadsDraft(heads_models[kind], target)
    generator = torch.Generator().manual_seed(11)
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
    speculated = 0
    for _ in range(SAMPLES):
        gen = decode(target, heads, drafter, sampling, generator)
        counts[gen.tokens[1], gen.tokens[2]] += 1
        speculated += sum(r.accepted for r in gen.rounds)
    assert speculated > SAMPLES // 4  # drafts were really accepted along the way
    expected = exact_second_and_third(target_model, sampling) * SAMPLES
    assert chi_square_pvalue(counts, expected) > P_VALUE_THRESHOLD


def test_stated_power():
    """The module docstring's power: >= 0.9 at divergence 0.035 with 1500 samples for df <= 35."""
    from scipy.stats import chi2, ncx2

    for df in (10, 20, 35):
        assert ncx2.sf(chi2.isf(P_VALUE_THRESHOLD, df), df, 0.035 * SAMPLES) >= 0.9


def test_bpd_verifies_against_the_rows_its_drafts_were_drawn_from(sampled_setup, monkeypatch):
    """Exact, where the chi-square test has little power: every row handed to `verify_chain` is the row
    the draft was sampled from, for bpd (a temperature mismatch between the two moves the output law by a
    chi-square divergence of about 0.01, below what 1500 samples detect)."""
    import polydraft.decoding.blockwise as blockwise
    import polydraft.decoding.chain as chain

    target_model, _, heads_models = sampled_setup
    drawn, verified = [], []

    def spy_sample(probs, generator):
        drawn.append(probs.clone())
        return sample(probs, generator)

    def spy_verify(drafts, draft_probs, target_probs, generator):
        verified.append(draft_probs.clone())
        return verify_chain(drafts, draft_probs, target_probs, generator)

    monkeypatch.setattr(blockwise, "sample", spy_sample)
    monkeypatch.setattr(chain, "verify_chain", spy_verify)
    target = CachedLM(target_model)
    heads = HeadsDraft(heads_models["medusa"], target)
    generator = torch.Generator().manual_seed(5)
    for _ in range(20):
        blockwise_chain(target, heads, PROMPT, 8, Sampling(temperature=0.7, top_k=4), generator, set())
    assert len(drawn) == len(verified) > 20
    for rows, checked in zip(drawn, verified):
        assert torch.equal(rows, checked)
