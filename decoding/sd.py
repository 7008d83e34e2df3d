"""`sd`: speculative decoding with a chain of draft tokens verified in one target call (seed 002 §2).

The rounds are `decoding.chain`'s: each round the drafter proposes up to K tokens (the controller may
stop earlier), the target scores the pending committed token(s) plus the K drafts in one forward pass
(head applied to the last K+1 rows only), and the drafts are verified greedily or by rejection sampling.
With `greedy_drafts` the drafter proposes its argmax and p is one-hot at it (what vLLM's draft-model
method does by default): still exact, but a draft token is accepted with probability q(x).
Rejected positions are cropped from both caches; the drafter never saw its last draft, so it is
behind by the tokens it has not processed, which it reads as pending input next round.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from polydraft.decoding.chain import ControlledDrafting, chain_decode, draft_tokens, target_call
from polydraft.decoding.control import BetaTS, CaliTS, FixedK
from polydraft.decoding.engine import Generation, Output, finish
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling

Controller = FixedK | BetaTS | CaliTS


class DrafterProposer(ControlledDrafting):
    """A separate drafter model on its own cache, drafting for `target` (`Proposer`)."""

    def __init__(
        self,
        target: CachedLM,
        drafter: CachedLM,
        control: Controller,
        sampling: Sampling,
        generator: torch.Generator,
        greedy_drafts: bool,
    ) -> None:
        super().__init__(control)
        self.target, self.drafter, self.sampling, self.generator = target, drafter, sampling, generator
        self.greedy_drafts = greedy_drafts

    def _step(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        logits, hidden = self.drafter.forward(input_ids)
        return logits[-1], hidden[-1]

    def draft(self, out: Output, budget: int) -> tuple[Tensor, Tensor | None]:
        budget = self.draft_budget(out, budget)
        if not budget:
            return out.ids[:0], None
        self.control.begin_round(self.target_hidden)
        first = out.pending(self.drafter.length)
        return draft_tokens(
            self._step, first, budget, self.control, self.sampling, self.generator, self.greedy_drafts
        )

    def verify(self, out: Output, drafts: Tensor) -> tuple[Tensor, Tensor]:
        extra = self.state_rows(drafts)
        logits, hidden = target_call(self.target, out, drafts, extra)
        return self.settled(logits, hidden, drafts, extra)

    def keep(self, n: int, accepted: int, drafts: int, hidden: Tensor) -> None:
        # the target cached the pending tokens and all the drafts; the drafter all but its last draft
        self.target.crop(n + accepted)
        if drafts:
            self.drafter.crop(n + min(accepted, drafts - 1))
        self.controlled(drafts, accepted, hidden)


@torch.inference_mode()
def speculative(
    target: CachedLM,
    drafter: CachedLM,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    control: Controller,
    generator: torch.Generator,
    eos_ids: set[int],
    greedy_drafts: bool = False,
) -> Generation:
    """Decode one prompt with `sd`; at temperature 0 the output is `ar`'s, token for token."""
    start = time.perf_counter()
    target.reset()
    drafter.reset()
    control.start()
    out = Output(prompt.to(target.device), max_new_tokens, eos_ids, slack=control.max_length + 1)
    proposer = DrafterProposer(target, drafter, control, sampling, generator, greedy_drafts)
    rounds = chain_decode(proposer, out, sampling, generator)
    return finish(out, start, target, drafter, rounds)
