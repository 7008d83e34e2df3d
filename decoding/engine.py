"""What every decoder shares: the output being built, the record of a generation, and `ar` itself.

A decoder commits tokens into an `Output`: a device buffer of prompt + generated ids (models read
their pending inputs from it) and the generated ids as a Python list (for EOS checks and the result).
Committing stops at the first EOS token (kept, as `generate` keeps it) and at `max_new_tokens`, so
every decoder ends exactly where `ar` ends.

Each model's cache holds a prefix of the committed ids; the tokens a model has not seen yet are
`Output.pending(model.length)`. At the start nothing is cached, so the first call of each model
processes the whole prompt (and, for the target, produces the first token): no separate prefill,
and every target call yields at least one token, which makes `ar`'s block efficiency exactly 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling, probabilities, sample


@dataclass
class Round:
    """One target call: what was drafted and what was kept."""

    draft_length: int
    """K of a chain, depth of a tree (0 for a plain target step)."""
    drafted: int
    """Draft tokens sent to the target: K for a chain, the number of nodes for a tree."""
    accepted: int
    """Draft tokens accepted and kept in the output."""


@dataclass
class Generation:
    """The result of decoding one prompt, with what the metrics need."""

    tokens: list[int]
    """Generated ids (the prompt excluded), EOS included when reached."""
    stop: str
    """`eos` or `length`."""
    rounds: list[Round] = field(default_factory=list)
    target_calls: int = 0
    draft_calls: int = 0
    wall_seconds: float = 0.0
    target_seconds: float = 0.0
    """Time inside the target's forward passes."""
    draft_seconds: float = 0.0
    """Time inside the drafter's forward passes (for `eesd`: the shared layers and exit layers; for the
    blockwise decoders: the heads and the rescoring drafter)."""
    rescore_seconds: float = 0.0
    """Blockwise decoders with rescoring: the rescoring drafter's share of `draft_seconds`."""


class Output:
    """Prompt + committed tokens, on the models' device, with EOS and length handling."""

    def __init__(self, prompt: Tensor, max_new_tokens: int, eos_ids: set[int], slack: int) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt = prompt.view(-1)
        self.prompt_length = prompt.numel()
        if self.prompt_length == 0:
            raise ValueError("the prompt is empty")
        # slack: room for the tokens a decoder may write past the last commit in one round
        self.ids = torch.empty(
            self.prompt_length + max_new_tokens + slack, dtype=torch.long, device=prompt.device
        )
        self.ids[: self.prompt_length] = prompt
        self.length = self.prompt_length
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.new: list[int] = []
        self.done = False
        self.stop = "length"

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.new)

    def pending(self, cached: int) -> Tensor:
        """Committed ids a model with `cached` positions has not processed yet, as [1, n]."""
        return self.ids[cached : self.length].view(1, -1)

    def commit(self, tokens: list[int], device_tokens: Tensor | None = None) -> int:
        """Append tokens up to the first EOS and the length limit; returns how many were kept."""
        count = min(len(tokens), self.remaining)
        for i in range(count):
            if tokens[i] in self.eos_ids:
                count = i + 1
                self.stop = "eos"
                self.done = True
                break
        if device_tokens is None:
            device_tokens = torch.tensor(tokens[:count], dtype=torch.long)
        self.ids[self.length : self.length + count] = device_tokens[:count]
        self.length += count
        self.new.extend(tokens[:count])
        if self.remaining == 0:
            self.done = True
        return count


def next_token(logits: Tensor, sampling: Sampling, generator: torch.Generator) -> Tensor:
    """The token that follows `logits` [V] as [1]: argmax, or a draw from the processed distribution."""
    if sampling.greedy:
        return logits.argmax(-1, keepdim=True)
    return sample(probabilities(logits, sampling), generator).view(1)


def finish(
    out: Output, start: float, target: CachedLM, drafter: CachedLM | None, rounds: list[Round]
) -> Generation:
    return Generation(
        tokens=out.new,
        stop=out.stop,
        rounds=rounds,
        target_calls=target.calls,
        draft_calls=drafter.calls if drafter is not None else 0,
        wall_seconds=time.perf_counter() - start,
        target_seconds=target.seconds,
        draft_seconds=drafter.seconds if drafter is not None else 0.0,
    )


@torch.inference_mode()
def autoregressive(
    target: CachedLM,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    eos_ids: set[int],
) -> Generation:
    """`ar`: one target call per token, through the same cache handling and sampling code as the others."""
    start = time.perf_counter()
    target.reset()
    out = Output(prompt.to(target.device), max_new_tokens, eos_ids, slack=1)
    rounds: list[Round] = []
    while not out.done:
        logits, _ = target.forward(out.pending(target.length))
        token = next_token(logits[-1], sampling, generator)
        out.commit([int(token)], token)
        rounds.append(Round(0, 0, 0))
    return finish(out, start, target, None, rounds)
