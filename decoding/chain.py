"""The chain-decoding round shared by `sd`, `eesd` and `bpd` / `bpd+rescore` (trees share `decoding.tree.tree_decode`).

A round: draft up to K tokens after the committed ones, score the pending committed token(s) and the
drafts in one target call (the last K+1 rows), accept a prefix of the drafts, commit the accepted drafts
plus the target's own next token, and drop the rejected positions from every cache. What differs between
the decoders is who drafts, how the target call is made and which caches hold what: that is a
`Proposer`. `chain_decode` runs the rounds the same way for all:

- the budget: at most `proposer.max_drafts()` drafts, and at most `remaining - 1`, so that a round never
  writes past `max_new_tokens` (a proposer with nothing to draft from yet says 0: a plain target step);
- greedy verification (`accept_greedy`): the drafts are accepted while they equal the target's argmax;
  the new tokens are then exactly the target's argmaxes up to and including the first disagreement;
- sampling (`accept_sampled`, i.e. `verify_chain`): accept draft j with min(1, q/p), draw a rejected
  position's token from the residual (q - p)+, or a bonus token from q after the last draft. p is the
  row each draft was drawn from, as the proposer reports it.

`draft_tokens` is the drafting loop of a drafter model stepped one token at a time (`sd`, `eesd`), with
its draft-length controller deciding after each token whether to go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from polydraft.decoding.engine import Output, Round
from polydraft.decoding.sampling import Sampling, probabilities, sample, verify_chain


class Proposer(Protocol):
    """Who drafts and how the target verifies, for one sequence (`chain_decode`)."""

    def max_drafts(self) -> int:
        """Drafts the next round may make (0: a plain target step, e.g. before any target state)."""
        ...

    def draft(self, out: Output, budget: int) -> tuple[Tensor, Tensor | None]:
        """Up to `budget` (>= 1) draft tokens [k] after `out`'s committed ones, and when sampling the
        rows [k, V] they were drawn from (None at temperature 0)."""
        ...

    def verify(self, out: Output, drafts: Tensor) -> tuple[Tensor, Tensor]:
        """One target call over the pending committed token(s) and `drafts`: logits [k+1, V] and final
        hidden states [k+1, H] of the last k+1 positions; of fewer rows when only the first k drafts are
        to be verified (the rest are then rejected unseen)."""
        ...

    def keep(self, n: int, accepted: int, drafts: int, hidden: Tensor) -> None:
        """After verification of `drafts` tokens drafted at length `n`, `accepted` of them kept: drop the
        rejected positions from every cache; `hidden[accepted]` is the target state of the newest token."""
        ...


def accept_greedy(predicted: Tensor, drafts: Tensor) -> tuple[int, list[int]]:
    """Greedy verification: (accepted count, new tokens) from the target's argmaxes [K+1] and drafts [K]."""
    k = drafts.shape[0]
    values = torch.cat([predicted, drafts]).tolist()  # one host sync per round
    pred, draft = values[: k + 1], values[k + 1 :]
    accepted = 0
    while accepted < k and draft[accepted] == pred[accepted]:
        accepted += 1
    return accepted, pred[: accepted + 1]


def accept_sampled(
    logits: Tensor, drafts: Tensor, draft_probs: Tensor | None, sampling: Sampling, generator: torch.Generator
) -> tuple[int, Tensor]:
    """Rejection-sampling verification: (accepted count, new tokens as a device tensor)."""
    q = probabilities(logits, sampling)
    if drafts.numel() == 0:
        return 0, sample(q[-1], generator).view(1)
    assert draft_probs is not None, "sampled drafts come with the rows they were drawn from"
    accepted, token = verify_chain(drafts, draft_probs, q, generator)
    return accepted, torch.cat([drafts[:accepted], token])


def chain_decode(
    proposer: Proposer, out: Output, sampling: Sampling, generator: torch.Generator
) -> list[Round]:
    """Run rounds until `out` is done; returns them."""
    rounds: list[Round] = []
    while not out.done:
        n = out.length
        budget = min(proposer.max_drafts(), out.remaining - 1)
        drafts, draft_probs = proposer.draft(out, budget) if budget > 0 else (out.ids[:0], None)
        drafted = drafts.shape[0]
        logits, hidden = proposer.verify(out, drafts)
        k = logits.shape[0] - 1  # fewer than drafted: Cali-TS's first round (`ControlledDrafting`)
        drafts = drafts[:k]
        draft_probs = draft_probs[:k] if draft_probs is not None else None
        if sampling.greedy:
            predicted = logits.argmax(-1)
            accepted, new = accept_greedy(predicted, drafts)
            new_device = predicted[: accepted + 1]
        else:
            accepted, new_device = accept_sampled(logits, drafts, draft_probs, sampling, generator)
            new = new_device.tolist()
        proposer.keep(n, accepted, k, hidden)
        kept = out.commit(new, new_device)
        rounds.append(Round(k, drafted, min(accepted, kept)))
    return rounds


def target_call(target: Any, out: Output, drafts: Tensor, extra: int = 0) -> tuple[Tensor, Tensor]:
    """`Proposer.verify` for a target on its own cache (`CachedLM`): the committed tokens it has not
    cached and the drafts, logits and hidden states of the last k+1+extra rows."""
    verify_input = torch.cat([out.ids[target.length : out.length], drafts]).view(1, -1)
    return target.forward(verify_input, num_logits=drafts.shape[0] + 1 + extra)


class ControlledDrafting:
    """The draft-length controller's part of a drafter model's `Proposer` (`sd`, `eesd`): how many
    drafts a round may make, the controller's view of each round, and the target state Cali-TS reads.

    Cali-TS's first round has no target state yet (`decoding.control`): it drafts up to the cap, its one
    target call also returns the state at the position before the last pending token (`state_rows`),
    and `settled` keeps the rows of the drafts the controller then chooses."""

    def __init__(self, control: Any) -> None:
        self.control = control
        self.target_hidden: Tensor | None = None

    def max_drafts(self) -> int:
        return self.control.max_length

    def first_round(self) -> bool:
        """Cali-TS before any target state (the prompt's first round)."""
        return self.control.needs_target_hidden and self.target_hidden is None

    def draft_budget(self, out: Output, budget: int) -> int:
        """`budget`, or 0 in Cali-TS's first round after a one-token prompt: no state produced that token,
        so the round is a plain target step."""
        return 0 if self.first_round() and out.length < 2 else budget

    def state_rows(self, drafts: Tensor) -> int:
        """Extra hidden rows the round's target call returns before the k+1 it verifies: 1 in Cali-TS's
        first round, the state that produced the context's newest token."""
        return int(self.first_round() and drafts.shape[0] > 0)

    def settled(self, logits: Tensor, hidden: Tensor, drafts: Tensor, extra: int) -> tuple[Tensor, Tensor]:
        """The verification rows [k+1] of the drafts the round keeps, from a call that returned `extra`
        state rows first (`state_rows`): the first k drafts, k chosen now by `control.settle`."""
        if not extra:
            return logits, hidden
        k = self.control.settle(hidden[0], drafts.shape[0])
        return logits[1 : k + 2], hidden[1 : k + 2]

    def controlled(self, drafts: int, accepted: int, hidden: Tensor) -> None:
        """Tell the controller how the round went; keep the newest token's target state."""
        if drafts:
            self.control.update(drafts, accepted)
        if self.control.needs_target_hidden:
            self.target_hidden = hidden[accepted]


def draft_tokens(
    step: Callable[[Tensor], tuple[Tensor, Tensor]],
    first_input: Tensor,
    budget: int,
    control: Any,
    sampling: Sampling,
    generator: torch.Generator,
    greedy_drafts: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Draft up to `budget` tokens with a drafter stepped by `step(input_ids) -> (logits [V], hidden [H])`,
    starting from `first_input` [1, t]; `control.keep_drafting(i, hidden)` may stop after draft i.

    At temperature 0 the drafts are the argmaxes. When sampling they are drawn from the drafter's
    distribution after temperature / top-k / top-p, or, with `greedy_drafts`, they are its argmaxes with
    p one-hot at them (vLLM's draft-model default: still exact, a draft is accepted with probability q(x)).
    """
    drafts: list[Tensor] = []
    rows: list[Tensor] = []
    step_input = first_input
    for i in range(1, budget + 1):
        logits, hidden = step(step_input)
        if sampling.greedy:
            token = logits.argmax(-1, keepdim=True)
        elif greedy_drafts:
            token = logits.argmax(-1, keepdim=True)
            rows.append(torch.zeros_like(logits, dtype=torch.float32).scatter_(0, token, 1.0))
        else:
            p = probabilities(logits, sampling)
            token = sample(p, generator).view(1)
            rows.append(p)
        drafts.append(token)
        if i == budget or not control.keep_drafting(i, hidden):
            break
        step_input = token.view(1, 1)
    return torch.cat(drafts), torch.stack(rows) if rows else None
