"""`eagle3`: speculative decoding with an EAGLE-3 head drafting from the target's own features.

The target (`CachedLM` with the head's `aux_layers`) returns, with every forward, the feature-layer states
of the new positions. The head (`models.eagle3.Eagle3Head`) keeps its own one-layer KV cache:

- Catch-up: at the start of a round the head reads every committed position p it has no true feature for
  yet, the pair (feature g_p, token x_{p+1}) at position p, in one pass; its output at the last of them
  (p = n - 2, the token x_{n-1} being the one the target's last call produced) drafts token n.
- Draft step i > 1: the previous step's output as feature, the previous draft as token, one position on.
- Verification is the target's usual call over the pending token and the drafts (`target_call`); its
  features of the accepted positions are kept for the next catch-up. The head's cache is cropped back to
  the positions it read with true features: a draft step's entries were computed from its own outputs, and
  vLLM recomputes them the same way.

Positions are the tokens' own (the head's position p reads token p + 1), as vLLM's EAGLE proposer gives
them, so a head trained by `train.eagle3` drafts alike here and in vLLM. The rounds, acceptance (greedy or
rejection sampling over the target's vocabulary, the head's distribution being zero outside its draft
vocabulary) and draft-length control (fixed K, Beta-TS) are `decoding.chain`'s.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from transformers import DynamicCache

from polydraft.decoding.chain import ControlledDrafting, chain_decode, draft_tokens, target_call
from polydraft.decoding.engine import Generation, Output, finish
from polydraft.decoding.lm import CachedLM, additive_mask
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.sd import Controller


class Eagle3Drafter:
    """An EAGLE-3 head and its KV cache, for one sequence (batch size 1); the target's embeddings feed it."""

    def __init__(self, head: torch.nn.Module, embed_tokens: torch.nn.Module, profile: bool = True) -> None:
        self.head, self.embed = head, embed_tokens
        self.aux_layers = list(head.aux_layers)
        self.device = head.fc.weight.device
        self.sync = profile and self.device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.true_length = 0
        """Positions of the cache read with the target's features (the rest are draft steps')."""
        self.last: Tensor | None = None
        """The layer's output at the newest position: the next draft step's feature."""
        self.seconds = 0.0
        self.calls = 0

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def read(self, tokens: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        """Catch up on committed positions true_length.. (tokens [n], each the token after its position, and
        the target's features [n, 3H] there): (logits [V] over the target's vocabulary, normed hidden [H])
        of the newest one, the first draft's distribution."""
        if tokens.shape[0] != features.shape[0]:
            raise ValueError(f"{tokens.shape[0]} tokens for {features.shape[0]} feature rows")
        hidden = self.head.project(features.to(self.device))
        logits = self._forward(tokens, hidden)
        self.true_length = self.length
        return logits

    def step(self, token: Tensor) -> tuple[Tensor, Tensor]:
        """One draft step: `token` [1] at the next position, the newest output as its feature."""
        assert self.last is not None, "a draft step follows `read`"
        return self._forward(token.view(-1), self.last.view(1, -1))

    def drop_drafts(self) -> None:
        """Crop the cache to the positions read with true features (a draft step's entries go)."""
        self.crop(self.true_length)

    def crop(self, length: int) -> None:
        """Keep the first `length` cached positions."""
        self.cache.crop(-max(0, self.length - length))
        self.true_length = min(self.true_length, length)

    def _forward(self, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        start = time.perf_counter()
        first, n = self.length, tokens.shape[0]
        positions = torch.arange(first, first + n, device=self.device).view(1, -1)
        mask = None
        if n > 1:  # several new positions after a cached prefix: causal, aligned to the end
            allowed = torch.ones(n, first + n, dtype=torch.bool, device=self.device).tril(first)
            mask = additive_mask(allowed, hidden.dtype)
        embeds = self.embed(tokens.view(1, -1).to(self.embed.weight.device)).to(self.device)
        outputs = self.head(embeds, hidden.view(1, n, -1), positions, mask, self.cache)[0]
        self.last = outputs[-1]
        normed = self.head.normed(self.last)
        logits = self.head.to_target(self.head.lm_head(normed).float())
        if self.sync:
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return logits, normed


class Eagle3Proposer(ControlledDrafting):
    """The head drafting for `target` (`decoding.chain.Proposer`)."""

    def __init__(
        self,
        target: CachedLM,
        drafter: Eagle3Drafter,
        control: Controller,
        sampling: Sampling,
        generator: torch.Generator,
    ) -> None:
        super().__init__(control)
        self.target, self.drafter, self.sampling, self.generator = target, drafter, sampling, generator
        self.pending: Tensor | None = None
        """Target features [m, 3H] of the committed positions drafter.true_length.. the head has not read."""

    def max_drafts(self) -> int:
        # nothing to draft from before the target's first call (the prompt's features)
        return self.control.max_length if self.pending is not None else 0

    def draft(self, out: Output, budget: int) -> tuple[Tensor, Tensor | None]:
        assert self.pending is not None
        drafter = self.drafter
        tokens = out.ids[drafter.true_length + 1 : out.length]  # position p reads token p + 1
        features, self.pending = self.pending, None

        def step(input_ids: Tensor) -> tuple[Tensor, Tensor]:
            if input_ids is tokens:
                return drafter.read(tokens, features)
            return drafter.step(input_ids)

        self.control.begin_round(None)
        return draft_tokens(step, tokens, budget, self.control, self.sampling, self.generator)

    def verify(self, out: Output, drafts: Tensor) -> tuple[Tensor, Tensor]:
        return target_call(self.target, out, drafts)

    def keep(self, n: int, accepted: int, drafts: int, hidden: Tensor) -> None:
        self.target.crop(n + accepted)
        self.drafter.drop_drafts()
        features = self.target.features
        assert features is not None, "the target runs with the head's feature layers"
        # the verified call's rows: the pending committed token(s), then the drafts; keep the accepted
        kept = features[: features.shape[0] - drafts + accepted]
        self.pending = kept if self.pending is None else torch.cat([self.pending, kept])
        self.controlled(drafts, accepted, hidden)


@torch.inference_mode()
def eagle3_decode(
    target: CachedLM,
    drafter: Eagle3Drafter,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    control: Controller,
    generator: torch.Generator,
    eos_ids: set[int],
) -> Generation:
    """Decode one prompt with `eagle3`; at temperature 0 the output is `ar`'s, token for token."""
    if target.aux_layers != drafter.aux_layers:
        raise ValueError(
            f"the target runs with feature layers {target.aux_layers}, the head reads {drafter.aux_layers}"
        )
    start = time.perf_counter()
    target.reset()
    drafter.reset()
    control.start()
    out = Output(prompt.to(target.device), max_new_tokens, eos_ids, slack=control.max_length + 1)
    proposer = Eagle3Proposer(target, drafter, control, sampling, generator)
    rounds = chain_decode(proposer, out, sampling, generator)
    return finish(out, start, target, drafter, rounds)
