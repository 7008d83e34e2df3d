"""`sd`: speculative decoding with a chain of draft tokens verified in one target call (seed 002 §2).

Each round the drafter proposes up to K tokens (the controller may stop earlier), the target scores
the pending committed token(s) plus the K drafts in one forward pass (head applied to the last K+1
rows only), and:
- greedy: the drafts are accepted while they equal the target's argmax; the new tokens are then
  exactly the target's argmaxes up to and including the first disagreement (one host sync per round);
- sampling: `verify_chain` (accept with min(1, q/p), residual on rejection, bonus token otherwise).
  With `greedy_drafts` the drafter proposes its argmax and p is one-hot at it (what vLLM's draft-model
  method does by default): still exact, but a draft token is accepted with probability q(x).
Rejected positions are cropped from both caches; the drafter never saw its last draft, so it is
behind by the tokens it has not processed, which it reads as pending input next round.
At most `remaining - 1` drafts are made so that a round never writes past `max_new_tokens`.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from polydraft.decoding.control import BetaTS, CaliTS, FixedK
from polydraft.decoding.engine import Generation, Output, Round, finish
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling, probabilities, sample, verify_chain

Controller = FixedK | BetaTS | CaliTS


def accept_greedy(predicted: Tensor, drafts: Tensor) -> tuple[int, list[int]]:
    """Greedy verification: (accepted count, new tokens) from the target's argmaxes [K+1] and drafts [K]."""
    k = drafts.shape[0]
    values = torch.cat([predicted, drafts]).tolist()
    pred, draft = values[: k + 1], values[k + 1 :]
    accepted = 0
    while accepted < k and draft[accepted] == pred[accepted]:
        accepted += 1
    return accepted, pred[: accepted + 1]


def accept_sampled(
    logits: Tensor, drafts: Tensor, draft_probs: list[Tensor], sampling: Sampling, generator: torch.Generator
) -> tuple[int, Tensor]:
    """Rejection-sampling verification: (accepted count, new tokens as a device tensor)."""
    q = probabilities(logits, sampling)
    if drafts.numel() == 0:
        return 0, sample(q[-1], generator).view(1)
    accepted, token = verify_chain(drafts, torch.stack(draft_probs), q, generator)
    return accepted, torch.cat([drafts[:accepted], token])


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
    greedy = sampling.greedy
    target_hidden: Tensor | None = None
    rounds: list[Round] = []
    while not out.done:
        n = out.length
        budget = min(control.max_length, out.remaining - 1)
        if control.needs_target_hidden and target_hidden is None:
            budget = 0  # Cali-TS starts from a target state: the first call is a plain target step
        drafts: list[Tensor] = []
        draft_probs: list[Tensor] = []
        if budget > 0:
            control.begin_round(target_hidden)
            step_input = out.pending(drafter.length)
            for step in range(1, budget + 1):
                logits, hidden = drafter.forward(step_input)
                if greedy:
                    token = logits[-1].argmax(-1, keepdim=True)
                elif greedy_drafts:
                    token = logits[-1].argmax(-1, keepdim=True)
                    draft_probs.append(
                        torch.zeros_like(logits[-1], dtype=torch.float32).scatter_(0, token, 1.0)
                    )
                else:
                    p = probabilities(logits[-1], sampling)
                    token = sample(p, generator).view(1)
                    draft_probs.append(p)
                drafts.append(token)
                if step == budget or not control.keep_drafting(step, hidden[-1]):
                    break
                step_input = token.view(1, 1)
        k = len(drafts)
        draft_tokens = torch.cat(drafts) if k else out.ids[:0]
        verify_input = torch.cat([out.ids[target.length : n], draft_tokens]).view(1, -1)
        logits, hidden = target.forward(verify_input, num_logits=k + 1)
        if greedy:
            predicted = logits.argmax(-1)
            accepted, new = accept_greedy(predicted, draft_tokens)
            new_device = predicted[: accepted + 1]
        else:
            accepted, new_device = accept_sampled(logits, draft_tokens, draft_probs, sampling, generator)
            new = new_device.tolist()
        # the target cached the pending tokens and all k drafts; the drafter all but its last draft
        target.crop(n + accepted)
        if k:
            drafter.crop(n + min(accepted, k - 1))
            control.update(k, accepted)
        if control.needs_target_hidden:
            target_hidden = hidden[accepted]
        kept = out.commit(new, new_device)
        rounds.append(Round(k, k, min(accepted, kept)))
    return finish(out, start, target, drafter, rounds)
