"""Exact output laws of the blockwise decoders, integrated through the real decoders.

`bpd`, `medusa` and `bpd+rescore` run unchanged (`decoding.blockwise` on the table models and random heads
of tests/decoder_grid.py) under a `DecoderExplorer`: the explorer of tests/exact_sampling.py, which also
takes over the decoders' other sources of randomness, each by the law it is proved to draw from:

- `sample` wherever a decoder imported it, rows of a [N, V] tensor drawn independently (what
  `torch.multinomial` does; `bpd` draws its K drafts at once);
- `gumbel_topk` in `decoding.lattice` (the Medusa candidate tree): k tokens per row drawn in order without
  replacement (the Gumbel-top-k trick; tests/decoding/test_decoding_exact.py checks the top-k of the perturbed
  log-probabilities, tests/decoding/test_decoding_sampling.py the noise);
- `stochastic_beam_step` in `decoding.tree` at width 1 (`bpd+rescore` when sampling draws one path): one
  token from the row, as the Gumbel-max trick gives (truncating the Gumbels is monotone per parent, so
  the argmax stays the argmax). Wider beams raise: their joint law is not integrated here.

So what is integrated is everything else: which rows the drafts come from, which rows verification gets
(`verify_chain`, `verify_tree`), the caches, the rounds and the bonus tokens. The law of all LENGTH = K + 2
generated tokens must be the target's joint law to 1e-6, every output of it.

`medusa+rescore` grows its tree by a stochastic beam search of width > 1; its verification step is
checked exactly on the rescored lattice instead (`check_rescored_tree`): a tree drawn level by level
without replacement from the rows `decoding.lattice.rescorer` makes of random heads and a drafter,
verified by `verify_tree`, gives the target's law.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch
from torch import Tensor

import polydraft.decoding.blockwise
import polydraft.decoding.chain
import polydraft.decoding.engine
import polydraft.decoding.lattice
import polydraft.decoding.tree
from polydraft.decoding.lattice import rescorer
from polydraft.decoding.sampling import Sampling
from tests import decoder_grid
from tests.exact_sampling import PAIRS, TOLERANCE, Explorer, Rows, V, assert_target_law, tree_law


class DecoderExplorer(Explorer):
    """`Explorer` over a whole decoder: every random draw of `decoding.blockwise`'s decoders (module docstring)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(monkeypatch)
        for module in (polydraft.decoding.engine, polydraft.decoding.chain, polydraft.decoding.blockwise):
            monkeypatch.setattr(module, "sample", self.sample)
        monkeypatch.setattr(polydraft.decoding.lattice, "gumbel_topk", self.gumbel_topk)
        monkeypatch.setattr(polydraft.decoding.tree, "stochastic_beam_step", self.beam_of_one)

    def sample(self, probs: Tensor, generator) -> Tensor:
        if probs.dim() == 2:
            return torch.stack([super(DecoderExplorer, self).sample(row, generator) for row in probs])
        return super().sample(probs, generator)

    def gumbel_topk(self, log_probs: Tensor, k: int, generator) -> tuple[Tensor, Tensor]:
        if generator is None:
            values, tokens = torch.topk(log_probs, k, dim=-1)
            return tokens, values > float("-inf")
        tokens = torch.zeros(log_probs.shape[0], k, dtype=torch.long)
        valid = torch.zeros(log_probs.shape[0], k, dtype=torch.bool)
        for row, log_p in enumerate(log_probs):
            drawn = self.draw_without_replacement(log_p.exp(), k)
            tokens[row, : len(drawn)] = torch.tensor(drawn, dtype=torch.long)
            valid[row, : len(drawn)] = True
        return tokens, valid

    def beam_of_one(self, log_probs: Tensor, sum_log_probs: Tensor, gamma: Tensor, width: int, generator):
        if generator is None or width != 1 or log_probs.shape[0] != 1:
            raise TypeError(f"only a sampled beam of width 1 is integrated, got width {width}")
        probs = log_probs[0].double().exp()
        token = self.choose((probs / probs.sum()).tolist())
        score = sum_log_probs + log_probs[0, token]
        return [0], [token], score.view(1), gamma


def decoder_law(explorer: DecoderExplorer, method: str, sampling: Sampling) -> tuple[dict, set[str]]:
    """The exact law of the LENGTH tokens `method` generates, and which kinds of rounds occurred."""
    decode = decoder_grid.blockwise_decoder(method, sampling, torch.Generator())
    seen: set[str] = set()

    def program(ex: Explorer) -> Hashable:
        gen = decode()
        for r in gen.rounds:
            if r.draft_length:
                seen.add("full" if r.accepted == r.draft_length else "rejected")
        return tuple(gen.tokens)

    return explorer.law(program), seen


def check_blockwise(monkeypatch: pytest.MonkeyPatch, method: str, sampling_name: str) -> None:
    """The real decoder's output law equals the target's joint law over LENGTH tokens, output by output."""
    sampling = decoder_grid.SAMPLINGS[sampling_name]
    law, seen = decoder_law(DecoderExplorer(monkeypatch), method, sampling)
    expected = decoder_grid.exact_law(sampling)
    assert seen == {"full", "rejected"}, f"rounds seen: {seen}"
    assert set(law) <= set(expected), f"outputs of probability zero: {sorted(set(law) - set(expected))}"
    for tokens, probability in expected.items():
        assert abs(law.get(tokens, 0.0) - probability) < TOLERANCE, (
            tokens,
            law.get(tokens, 0.0),
            probability,
        )


class RescoredRows:
    """r_j(. | y_<j) of `decoding.lattice.rescorer`: random heads (one row per level) rescored by a drafter."""

    def __init__(self, depth: int, seed: int, sampling: Sampling, top_k: int, weight: float) -> None:
        heads = Rows(V, seed + 7, sampling, family=2)
        # float32, as `decoding.lattice.head_log_probs` gives them
        head_logp = torch.stack([heads((level,)) for level in range(depth)]).log().float()
        self.drafter = Rows(V, seed + 11, Sampling(1.0))
        self.rescore = rescorer(head_logp, top_k, weight, sampling)
        self.memo: dict[tuple[int, ...], Tensor] = {}

    def __call__(self, context: tuple[int, ...]) -> Tensor:
        found = self.memo.get(context)
        if found is None:
            logits = self.drafter(context).log().view(1, -1)  # the drafter's logits after the path so far
            found = self.memo[context] = self.rescore(len(context), logits)[0].double().exp()
        return found


def check_rescored_tree(monkeypatch: pytest.MonkeyPatch, pair: str, seed: int = 0) -> None:
    """`medusa+rescore`'s verification: a beam-like tree (0 to W = 3 children per node, the count depending
    on the path, as in a stochastic beam; 2 at the root, so that a truncated lattice row of 3 tokens can
    still see all its children rejected) drawn from the rescored lattice of depth 3, top 4, lambda 0.5."""
    draft, target = PAIRS[pair]
    width, depth = 3, 3
    p, q = RescoredRows(depth, seed, draft, top_k=4, weight=0.5), Rows(V, seed + 1, target)

    def more(context: tuple[int, ...], drawn: list[int]) -> bool:
        allotted = (sum(context) + len(context)) % (width + 1) if context else 2
        return len(drawn) < allotted and not (drawn and drawn[-1] == 3)

    assert_target_law(tree_law(Explorer(monkeypatch), p, q, depth, more), q, depth + 1)
