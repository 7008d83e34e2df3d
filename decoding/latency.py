"""Forward latencies of the models a decoder calls, and the speedup they imply (the ideal speedup).

A speculative round is one target call on the pending and drafted tokens plus the drafter calls that
drafted them. With t_T(n) the latency of a target forward on n new tokens (t_T(1): an `ar` step) and
t_D,i the drafter's i-th step of a round:
- a chain round (`sd`, `eesd`) with k drafts costs t_T(k + 1) + t_D,1 + ... + t_D,k;
- a tree round (`rsd_c`, `rsd_s`) of depth L and N nodes costs t_T(N + 1) with the tree mask, plus
  t_D(1) on the root and one masked drafter call per level but the last, on that level's nodes.
Over the rounds of a set of generations, the ideal speedup is what these latencies allow when nothing
else costs time: tokens x t_T(1) / sum of the rounds' costs, which for a fixed K is
BE x t_T(1) / (t_T(K + 1) + K t_D). The measured speedup is lower by what the formula leaves out:
the engine's own work (acceptance, sampling, cache edits, controllers) and the first call of each
model on the whole prompt.

Chain rounds are timed as the decoders make them, one round after the other: the drafter's steps
right after the target's previous verification, then the verification. On a CPU a model's call is
slower right after the other model ran (its weights and activations are no longer in the CPU's caches):
with the demo's 24-layer target, the drafter's first step of a round took 0.49-0.51 ms against 0.26 ms
in a loop of its own steps, and a verification of 5 tokens 7-9% more after drafter steps than after
target steps (bench/results/demo_task.md). Timing the models apart would charge that to the engine.
Tree rounds are timed apart, size by size (their ideal leaves it out).

For `eesd` the "target" of a round is the early-exit verification (the shared layers on the last
draft, then the target's deeper layers on all k + 1 positions) and a "drafter" step one exit step (the
shared layers plus the exit layers), as `decoding.eesd` runs them.

Latencies are medians over repeats of the very calls the decoders make (`CachedLM.forward` then `crop`;
`SelfSpeculative.draft_step` / `verify` then `crop`), timed by the models' own forward clocks, on a
cache that holds a realistic context. Every size of every model is measured once per repeat,
interleaved, so a slow spell of the machine hits them alike.
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


@dataclass(frozen=True)
class ChainRounds:
    """Median seconds of the calls of a chain round, timed inside rounds (see the module's docstring)."""

    verify: dict[int, float]
    """Verification of k + 1 positions after k drafts (k = 0: a target step after the last round's)."""
    draft: list[float]
    """The drafter's i-th step of a round at index i - 1 (the first one follows a verification)."""

    def as_json(self) -> dict[str, dict[str, float] | list[float]]:
        return {"verify": {str(n): s for n, s in sorted(self.verify.items())}, "draft": self.draft}


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


def _check_sizes(context: Tensor, max_drafts: int, repeats: int) -> None:
    if repeats < 1 or max_drafts < 0 or max_drafts + 1 >= context.shape[1]:
        raise ValueError(
            f"latency sizes must be in 1..{context.shape[1] - 1} and repeats >= 1, "
            f"got up to {max_drafts} drafts + 1, repeats {repeats}"
        )


def _medians(verify: dict[int, list[float]], draft: list[list[float]]) -> ChainRounds:
    return ChainRounds(_median(verify), [statistics.median(values) for values in draft])


@torch.inference_mode()
def chain_round_latencies(
    target: CachedLM, drafter: CachedLM, context: Tensor, max_drafts: int, repeats: int
) -> ChainRounds:
    """`sd`'s rounds of k = 0..max_drafts drafts after `context` [1, c], one after the other: k drafter
    calls on one token each, then the target on k + 1 tokens; both models cropped back to the context."""
    _check_sizes(context, max_drafts, repeats)
    for lm in (target, drafter):
        lm.reset()
        lm.forward(context.to(lm.device))
    length = target.length
    tokens = context[:, 1:].to(target.device)
    verify: dict[int, list[float]] = {k + 1: [] for k in range(max_drafts + 1)}
    draft: list[list[float]] = [[] for _ in range(max_drafts)]
    for _ in range(repeats):
        for k in range(max_drafts + 1):
            for i in range(k):
                before = drafter.seconds
                drafter.forward(tokens[:, i : i + 1].to(drafter.device))
                draft[i].append(drafter.seconds - before)
            before = target.seconds
            target.forward(tokens[:, : k + 1], num_logits=k + 1)
            verify[k + 1].append(target.seconds - before)
            target.crop(length)
            drafter.crop(length)
    target.reset()
    drafter.reset()
    return _medians(verify, draft)


@torch.inference_mode()
def self_speculative_latencies(model, context: Tensor, max_drafts: int, repeats: int) -> ChainRounds:
    """`eesd`'s rounds (a `decoding.eesd.SelfSpeculative`) of k = 0..max_drafts drafts after `context`,
    one after the other: k exit steps on one token each, then the verification of k + 1 positions (the
    shared layers on the last draft, the deeper layers on all k + 1); every slot group cropped back."""
    _check_sizes(context, max_drafts, repeats)
    context = context.to(model.device)
    model.reset()
    model.draft_step(context)
    model.verify(context[:, :0], 1)
    length = context.shape[1]
    tokens = context[:, 1:]
    verify: dict[int, list[float]] = {k + 1: [] for k in range(max_drafts + 1)}
    draft: list[list[float]] = [[] for _ in range(max_drafts)]
    for _ in range(repeats):
        for k in range(max_drafts + 1):
            for i in range(k):
                before = model.draft_seconds
                model.draft_step(tokens[:, i : i + 1])
                draft[i].append(model.draft_seconds - before)
            before = model.target_seconds
            model.verify(tokens[:, k : k + 1], k + 1)
            verify[k + 1].append(model.target_seconds - before)
            model.crop(length, length)
    model.reset()
    return _medians(verify, draft)


def chain_cost(rounds: ChainRounds) -> RoundCost:
    """Cost of a chain round: t_T(k + 1) + t_D,1 + ... + t_D,k."""

    def cost(round: Round) -> float:
        return rounds.verify[round.drafted + 1] + sum(rounds.draft[: round.drafted])

    return cost


def ar_cost(target: Latencies) -> RoundCost:
    """Cost of an `ar` round: one target step."""
    return lambda round: target.chain[1]


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
    """The target alone: an `ar` step, and every tree verification size."""
    drafters: dict[str, Latencies]
    """Standalone drafters alone, by name: one step, and every tree level size."""
    rounds: dict[str, ChainRounds]
    """Chain rounds by drafter name: `sd`'s for a standalone drafter, `eesd`'s for an early-exit one."""

    def as_json(self) -> dict:
        return {
            "target": self.target.as_json(),
            "drafters": {name: lat.as_json() for name, lat in self.drafters.items()},
            "rounds": {name: rounds.as_json() for name, rounds in self.rounds.items()},
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
    """Every latency the run's decoders need: the target's step (and every tree size), each standalone
    drafter's step (and every tree level), the chain rounds of up to max_draft_length drafts of each
    standalone and early-exit drafter. Every probe runs once per repeat, in turn, so that a slow spell of
    the machine hits the `ar` step and the rounds it is compared with alike; medians over the repeats."""
    max_nodes = max((shape.max_nodes for shape in shapes), default=0)
    levels = sorted({size for shape in shapes for size in shape.level_sizes(shape.depth)[:-1]})
    all_levels = list(range(1, max(levels) + 1)) if levels else []
    tree_sizes = list(range(2, max_nodes + 2)) if shapes else []
    target_samples: list[Latencies] = []
    drafter_samples: dict[str, list[Latencies]] = {name: [] for name in drafters}
    round_samples: dict[str, list[ChainRounds]] = {name: [] for name in [*drafters, *self_speculative]}
    for _ in range(repeats):
        target_samples.append(lm_latencies(target, context, [1], tree_sizes, 1))
        for name, lm in drafters.items():
            drafter_samples[name].append(lm_latencies(lm, context, [1], all_levels, 1))
            round_samples[name].append(chain_round_latencies(target, lm, context, max_draft_length, 1))
        for name, model in self_speculative.items():
            round_samples[name].append(self_speculative_latencies(model, context, max_draft_length, 1))
    return RunLatencies(
        target=_median_latencies(target_samples),
        drafters={name: _median_latencies(samples) for name, samples in drafter_samples.items()},
        rounds={name: _median_rounds(samples) for name, samples in round_samples.items()},
    )


def _median_latencies(samples: list[Latencies]) -> Latencies:
    return Latencies(
        {n: statistics.median(s.chain[n] for s in samples) for n in samples[0].chain},
        {n: statistics.median(s.tree[n] for s in samples) for n in samples[0].tree},
    )


def _median_rounds(samples: list[ChainRounds]) -> ChainRounds:
    return ChainRounds(
        {n: statistics.median(s.verify[n] for s in samples) for n in samples[0].verify},
        [statistics.median(s.draft[i] for s in samples) for i in range(len(samples[0].draft))],
    )
