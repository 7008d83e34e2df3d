"""Greedy decoding is lossless: every decoder's output is `ar`'s, token for token, and caches are exact.

Drafters that agree with the target fully (`copy`), partly (`noisy`) and hardly (`small`) exercise
full acceptance with bonus tokens, partial acceptance and rejections; prompts of several lengths,
length limits from 1 token up, and an EOS token taken from `ar`'s own output check where decoding stops.
"""

from __future__ import annotations

import pytest
import torch

from polydraft.decoding.control import BetaTS, CaliTS, FixedK
from polydraft.decoding.engine import Generation, autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.rsd import DrafterTree, recursive_speculative
from polydraft.decoding.sampling import Sampling, probabilities
from polydraft.decoding.sd import speculative
from polydraft.decoding.tree import TreeShape, ancestor_mask, draft_tree, target_order, tree_attention
from tests.decoding_helpers import single_thread_fixture, tiny_pair

single_thread = single_thread_fixture()
VOCAB = 96
GREEDY = Sampling()

DECODERS = {
    "sd-k1": ("sd", lambda seed: FixedK(1)),
    "sd-k3": ("sd", lambda seed: FixedK(3)),
    "sd-k6": ("sd", lambda seed: FixedK(6)),
    "sd-beta-ts": ("sd", lambda seed: BetaTS(1.0, 1.0, 8, seed)),
    "sd-cali-ts": ("sd", lambda seed: CaliTS(0.2, 0.3, 0.5, lambda i, t, d: 0.9 - 0.1 * i, 8, seed)),
    "rsd_c-221": ("tree", lambda seed: TreeShape.constant([2, 2, 1])),
    "rsd_c-31": ("tree", lambda seed: TreeShape.constant([3, 1])),
    "rsd_c-1111": ("tree", lambda seed: TreeShape.constant([1, 1, 1, 1])),
    "rsd_s-3x3": ("tree", lambda seed: TreeShape.beam(3, 3)),
    "rsd_s-2x4": ("tree", lambda seed: TreeShape.beam(2, 4)),
    "rsd_s-1x2": ("tree", lambda seed: TreeShape.beam(1, 2)),
}
CASES = [(1, 1), (1, 6), (3, 2), (8, 17), (15, 9), (5, 12)]
"""(prompt length, max_new_tokens)."""


@pytest.fixture(scope="module")
def pair():
    target, drafters = tiny_pair(VOCAB)
    return CachedLM(target), {name: CachedLM(model) for name, model in drafters.items()}


def run(decoder: str, target: CachedLM, drafter: CachedLM, prompt, max_new, eos, seed=0) -> Generation:
    kind, make = DECODERS[decoder]
    generator = torch.Generator().manual_seed(seed)
    if kind == "sd":
        return speculative(target, drafter, prompt, max_new, GREEDY, make(seed), generator, eos)
    return recursive_speculative(target, drafter, prompt, max_new, GREEDY, make(seed), generator, eos)


def check_record(gen: Generation) -> None:
    """One round per target call, and each round adds its accepted drafts plus one target token."""
    assert gen.target_calls == len(gen.rounds)
    assert sum(r.accepted + 1 for r in gen.rounds) >= len(gen.tokens) >= len(gen.rounds)
    assert all(r.accepted <= r.drafted for r in gen.rounds)


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_greedy_output_is_ar_output(pair, decoder):
    target, drafters = pair
    prompts = torch.Generator().manual_seed(1)
    for index, (length, max_new) in enumerate(CASES):
        prompt = torch.randint(0, VOCAB, (length,), generator=prompts)
        reference = autoregressive(target, prompt, max_new, GREEDY, torch.Generator(), set())
        assert len(reference.tokens) == max_new and reference.stop == "length"
        # an EOS that ar meets part-way (the token it generates at a middle position)
        eos = {reference.tokens[max_new // 2]}
        stopped = autoregressive(target, prompt, max_new, GREEDY, torch.Generator(), eos)
        assert stopped.tokens == reference.tokens[: reference.tokens.index(next(iter(eos))) + 1]
        assert stopped.stop == "eos"
        for name, drafter in drafters.items():
            for expected, eos_ids in ((reference, set()), (stopped, eos)):
                got = run(decoder, target, drafter, prompt, max_new, eos_ids, seed=index)
                assert got.tokens == expected.tokens, (decoder, name, length, max_new, eos_ids)
                assert got.stop == expected.stop
                check_record(got)


def test_speculation_really_happens(pair):
    """The equality above is not vacuous: the copy drafter is always accepted, the noisy one partly."""
    target, drafters = pair
    prompt = torch.arange(5)
    full = speculative(target, drafters["copy"], prompt, 20, GREEDY, FixedK(4), torch.Generator(), set())
    assert full.target_calls == 4  # 5 tokens per call (4 drafts + bonus)
    partly = run("rsd_s-3x3", target, drafters["noisy"], prompt, 20, set())
    assert 1 < len(partly.tokens) / partly.target_calls < 4


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def test_cached_logits_equal_uncached_logits_after_crops(pair):
    target, _ = pair
    model = target.model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (20,), generator=gen).tolist()
    with torch.inference_mode():
        target.reset()
        logits, hidden = target.forward(torch.tensor([ids[:7]]), num_logits=7)
        assert torch.allclose(logits, full_logits(model, ids[:7]), atol=1e-5)
        assert hidden.shape == (7, model.config.hidden_size)
        logits, _ = target.forward(torch.tensor([ids[7:12]]), num_logits=5)
        assert torch.allclose(logits, full_logits(model, ids[:12])[7:], atol=1e-5)
        # reject the last 3 positions, continue with other tokens
        target.crop(9)
        other = [5, 6, 7]
        logits, _ = target.forward(torch.tensor([other]), num_logits=3)
        assert torch.allclose(logits, full_logits(model, ids[:9] + other)[9:], atol=1e-5)


@pytest.mark.parametrize(
    "shape", [TreeShape.constant([2, 2, 1]), TreeShape.beam(3, 3)], ids=["rsd_c", "rsd_s"]
)
def test_tree_logits_equal_uncached_logits_of_each_path(pair, shape):
    """One masked target pass over the tree gives, at every node, the logits of the plain sequence
    prefix + path to that node; the drafter's level passes likewise; after `keep` the caches continue
    exactly like a fresh run on the accepted path."""
    target, drafters = pair
    drafter = drafters["noisy"]
    sampling = Sampling(temperature=1.5)
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        drafter.reset()
        target.reset()
        tree, draft_probs = draft_tree(
            drafter, torch.tensor([prompt]), shape, shape.depth, sampling, torch.Generator().manual_seed(1)
        )
        assert len(tree) > shape.depth  # a real tree, not a chain
        n = len(prompt)
        mask = tree_attention(
            0, n, ancestor_mask(tree.parents, range(len(tree)), target.device), target.dtype
        )
        positions = torch.cat([torch.arange(n), torch.tensor(tree.depths) + n - 1]).view(1, -1)
        logits, _ = target.forward(torch.tensor([prompt + tree.tokens]), len(tree) + 1, positions, mask)

        def path_to(node: int) -> list[int]:
            path = []
            while node >= 0:
                path.append(tree.tokens[node])
                node = tree.parents[node]
            return path[::-1]

        assert torch.allclose(logits[0], full_logits(target.model, prompt)[-1], atol=1e-5)
        for node in range(len(tree)):
            expected = full_logits(target.model, prompt + path_to(node))[-1]
            assert torch.allclose(logits[node + 1], expected, atol=1e-5), node
            if node < tree.fed:
                expected_p = probabilities(full_logits(drafter.model, prompt + path_to(node))[-1], sampling)
                assert torch.allclose(draft_probs[node + 1], expected_p, atol=1e-5), node
        # keep a deepest path, then the next token's logits must match a plain run on that path
        leaf = len(tree) - 1
        chain = []
        node = leaf
        while node >= 0:
            chain.append(node)
            node = tree.parents[node]
        chain.reverse()
        target.keep(n, chain)
        assert target.length == n + len(chain)
        nxt = [7]
        logits, _ = target.forward(torch.tensor([nxt]))
        assert torch.allclose(
            logits[0], full_logits(target.model, prompt + path_to(leaf) + nxt)[-1], atol=1e-5
        )
        drafter.keep(n, [i for i in chain if i < tree.fed])
        pending = path_to(leaf)[len([i for i in chain if i < tree.fed]) :] + nxt
        logits, _ = drafter.forward(torch.tensor([pending]))
        assert torch.allclose(
            logits[0], full_logits(drafter.model, prompt + path_to(leaf) + nxt)[-1], atol=1e-5
        )


def test_a_tree_proposer_gets_the_targets_state_at_the_newest_accepted_token(pair, monkeypatch):
    """After each round `tree_decode` hands its proposer the target's final hidden state at the newest
    accepted token (the heads of `bpd` and `medusa` draft the next tree from it): the last accepted
    node's, the root's when none is. The target read the nodes in `target_order`, so that state sits at
    the row of the node's input slot; the rounds here include paths that leave the chain of first
    children, where slot and node differ. Checked against one forward of the whole output."""
    target, drafters = pair
    seen: list[tuple[int, torch.Tensor]] = []
    moved = 0
    keep = DrafterTree.keep

    def record(self, n, tree, path, hidden):
        nonlocal moved
        if path and target_order(tree).index(path[-1]) != path[-1]:
            moved += 1
        seen.append((n - 1 + len(path), hidden.clone()))  # the position of the newest accepted token
        keep(self, n, tree, path, hidden)

    monkeypatch.setattr(DrafterTree, "keep", record)
    prompts = torch.Generator().manual_seed(3)
    for name in ("noisy", "small"):
        for length in (2, 9):
            seen.clear()
            prompt = torch.randint(0, VOCAB, (length,), generator=prompts)
            shape = TreeShape.beam(3, 3)
            got = recursive_speculative(
                target, drafters[name], prompt, 20, GREEDY, shape, torch.Generator(), set()
            )
            whole = torch.cat([prompt, torch.tensor(got.tokens)]).view(1, -1)
            with torch.inference_mode():
                states = target.decoder(input_ids=whole).last_hidden_state[0]
            assert len(seen) == len(got.rounds)
            for position, hidden in seen:
                torch.testing.assert_close(hidden, states[position], atol=1e-4, rtol=1e-4)
    assert moved >= 1
