"""Forward latencies of the models a decoder calls, and the speedup they imply (the ideal speedup).

A speculative round is one target call on the pending and drafted tokens plus the drafter calls that
drafted them. With t_T(n) the latency of a target forward on n new tokens (t_T(1): an `ar` step) and
t_D(n) the drafter's:
- a chain round (`sd`, `eesd`) with k drafts costs t_T(k + 1) + k t_D(1);
- a tree round (`rsd_c`, `rsd_s`) of depth L and N nodes costs t_T(N + 1) with the tree mask, plus
  t_D(1) on the root and one masked drafter call per level but the last, on that level's nodes.
Over the rounds of a set of generations, the ideal speedup is what these latencies allow when nothing
else costs time: tokens x t_T(1) / sum of the rounds' costs, which for a fixed K is
BE x t_T(1) / (t_T(K + 1) + K t_D(1)). The measured speedup is lower by what the formula leaves out:
the engine's own work (acceptance, sampling, cache edits, controllers) and the first call of each
model on the whole prompt.

For `eesd` the "target" of a round is the early-exit verification (the shared layers on the last
draft, then the target's deeper layers on all k + 1 positions) and the "drafter" one exit step (the
shared layers plus the exit layers), as `decoding.eesd` runs them.

Latencies are medians over repeats of the very calls the decoders make (`CachedLM.forward` then `crop`;
`SelfSpeculative.draft_step` / `verify` then `crop`), timed by the models' own forward clocks, on a
cache that holds a realistic context. All sizes are measured once per repeat, interleaved, so a slow
spell of the machine hits every size alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from decoding.engine import Generation, Round
from decoding.lm import CachedLM
from decoding.tree import TreeShape, tree_attention


@dataclass(frozen=True)
class Latencies:
    """Median seconds of one forward call by the number of new tokens it processes."""

    chain: dict[int, float] = field(default_factory=dict)
    """Causal calls (`ar`, `sd`, `eesd`, a tree's root call)."""
    tree: dict[int, float] = field(default_factory=dict)
    """Calls with an explicit tree mask and position ids (tree verification, tree levels)."""

    def as_json(self) -> dict[str, dict[str, float]]:
        return {
            "chain": {str(n): s for n, s in sorted(self.chain.items())},
            "tree": {str(n): s for n, s in sorted(self.tree.items())},
        }


RoundCost = Callable[[Round], float]


def _median(samples: dict[int, list[float]]) -> dict[int, float]:
    return {n: statistics.median(values) for n, values in samples.items()}


@torch.inference_mode()
def lm_latencies(
    lm: CachedLM, context: Tensor, chain_sizes: Sequence[int], tree_sizes: Sequence[int], repeats: int
) -> Latencies:
    """Latencies of `lm` on n new tokens after `context` [1, c] for each size (c must exceed every size).

    Tree calls use a causal pattern given as the explicit additive mask with explicit positions, the way
    `decoding.rsd` calls the models (a chain is a tree whose every node has one child)."""
    sizes = [*chain_sizes, *tree_sizes]
    if repeats < 1 or not sizes or max(sizes) >= context.shape[1] or min(sizes) < 1:
        raise ValueError(
            f"latency sizes must be in 1..{context.shape[1] - 1} and repeats >= 1, "
            f"got sizes {sizes}, repeats {repeats}"
        )
    lm.reset()
    lm.forward(context.to(lm.device))
    length = lm.length
    if tree_sizes and lm.window is not None and length + max(tree_sizes) >= lm.window:
        lm.reset()
        raise NotImplementedError(
            f"tree calls after {length} positions exceed the model's sliding window ({lm.window})"
        )
    tokens = context[:, 1:].to(lm.device)
    chain: dict[int, list[float]] = {n: [] for n in chain_sizes}
    tree: dict[int, list[float]] = {n: [] for n in tree_sizes}
    for _ in range(repeats):
        for n in chain_sizes:
            before = lm.seconds
            lm.forward(tokens[:, :n], num_logits=n)
            chain[n].append(lm.seconds - before)
            lm.crop(length)
        for n in tree_sizes:
            rows = torch.ones(n, n, dtype=torch.bool, device=lm.device).tril()
            mask = tree_attention(length, 0, rows, lm.dtype)
            positions = torch.arange(length, length + n, device=lm.device).view(1, -1)
            before = lm.seconds
            lm.forward(tokens[:, :n], n, positions, mask)
            tree[n].append(lm.seconds - before)
            lm.crop(length)
    lm.reset()
    return Latencies(_median(chain), _median(tree))


@torch.inference_mode()
def self_speculative_latencies(
    model, context: Tensor, verify_sizes: Sequence[int], repeats: int
) -> tuple[Latencies, Latencies]:
    """(verification, drafting) latencies of `eesd` (a `decoding.eesd.SelfSpeculative`) after `context`.

    Verification of n positions is timed as `eesd` runs it after n - 1 drafts: the shared layers on
    the last draft, then the deeper layers on all n; drafting is one exit step on one token."""
    if repeats < 1 or not verify_sizes or max(verify_sizes) >= context.shape[1] or min(verify_sizes) < 1:
        raise ValueError(
            f"latency sizes must be in 1..{context.shape[1] - 1} and repeats >= 1, "
            f"got sizes {list(verify_sizes)}, repeats {repeats}"
        )
    context = context.to(model.device)
    model.reset()
    model.draft_step(context)
    model.verify(context[:, :0], 1)
    length = context.shape[1]
    tokens = context[:, 1:]
    draft: list[float] = []
    verify: dict[int, list[float]] = {n: [] for n in verify_sizes}
    for _ in range(repeats):
        before = model.draft_seconds
        model.draft_step(tokens[:, :1])
        draft.append(model.draft_seconds - before)
        model.crop(length, length)
        for n in verify_sizes:
            if n > 1:
                model.draft_step(tokens[:, : n - 1])
            before = model.target_seconds
            model.verify(tokens[:, n - 1 : n], n)
            verify[n].append(model.target_seconds - before)
            model.crop(length, length)
    model.reset()
    return Latencies(_median(verify)), Latencies({1: statistics.median(draft)})


def chain_cost(target: Latencies, drafter: Latencies) -> RoundCost:
    """Cost of a chain round: t_T(k + 1) + k t_D(1)."""

    def cost(round: Round) -> float:
        return target.chain[round.drafted + 1] + round.drafted * drafter.chain[1]

    return cost


def tree_cost(target: Latencies, drafter: Latencies, shape: TreeShape) -> RoundCost:
    """Cost of a tree round: t_T(N + 1) masked, t_D(1) on the root, a masked call per level but the last."""

    def cost(round: Round) -> float:
        if round.draft_length == 0:  # one token left: a plain target step
            return target.chain[1]
        levels = shape.level_sizes(round.draft_length)[:-1]
        return target.tree[round.drafted + 1] + drafter.chain[1] + sum(drafter.tree[size] for size in levels)

    return cost


def ideal_speedup(generations: Sequence[Generation], target_step: float, cost: RoundCost) -> float | None:
    """tokens x t_T(1) / sum of the rounds' costs over these generations (None without rounds)."""
    rounds = [r for g in generations for r in g.rounds]
    if not rounds:
        return None
    tokens = sum(len(g.tokens) for g in generations)
    return tokens * target_step / sum(cost(r) for r in rounds)


@dataclass(frozen=True)
class RunLatencies:
    """What a measure run's ideal speedups are computed from."""

    target: Latencies
    drafters: dict[str, Latencies]
    """Standalone drafters by name."""
    self_speculative: dict[str, tuple[Latencies, Latencies]]
    """Early-exit drafters by name: (verification, drafting)."""

    def as_json(self) -> dict:
        return {
            "target": self.target.as_json(),
            "drafters": {name: lat.as_json() for name, lat in self.drafters.items()},
            "self_speculative": {
                name: {"verify": verify.as_json(), "draft": draft.as_json()}
                for name, (verify, draft) in self.self_speculative.items()
            },
        }


def run_latencies(
    target: CachedLM,
    drafters: dict[str, CachedLM],
    self_speculative: dict[str, object],
    context: Tensor,
    max_draft_length: int,
    shapes: Sequence[TreeShape],
    repeats: int,
) -> RunLatencies:
    """Every latency the run's decoders need: the target on 1..max_draft_length + 1 tokens (and on every
    tree size), each standalone drafter on 1 token (and on every tree level), each early-exit drafter's
    verification and drafting."""
    chain_sizes = list(range(1, max_draft_length + 2))
    max_nodes = max((shape.max_nodes for shape in shapes), default=0)
    levels = sorted({size for shape in shapes for size in shape.level_sizes(shape.depth)[:-1]})
    all_levels = list(range(1, max(levels) + 1)) if levels else []
    tree_sizes = list(range(2, max_nodes + 2)) if shapes else []
    return RunLatencies(
        target=lm_latencies(target, context, chain_sizes, tree_sizes, repeats),
        drafters={name: lm_latencies(lm, context, [1], all_levels, repeats) for name, lm in drafters.items()},
        self_speculative={
            name: self_speculative_latencies(model, context, chain_sizes, repeats)
            for name, model in self_speculative.items()
        },
    )
