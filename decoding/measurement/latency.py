"""Forward latencies of the models a decoder calls, and the speedup a latency model predicts from them.

A speculative round is one target call on the pending and drafted tokens plus the drafter calls that
drafted them. With t_T(n) the latency of a target forward on n new tokens (t_T(1): an `ar` step) and
t_D,i the drafter's i-th step of a round:
- a chain round (`sd`, `eesd`) with k drafts costs t_T(k + 1) + t_D,1 + ... + t_D,k;
- a tree round (`rsd_c`, `rsd_s`) of depth L and N nodes costs t_T(N + 1) with the tree mask, plus
  t_D(1) on the root and one masked drafter call per level but the last, on that level's nodes.
Each generation also starts with the first call of each of its models on the whole prompt, which costs
more than the round's call it stands for: the prompt's extra, F = t(prompt) - t(1 token) per model, timed
on the prompt the probes start from (`prompt`; F_T for the target, F_D for a standalone drafter, for
`eesd` and `eagle3` their whole prefill less their first round's calls). Over a set of generations, the
predicted speedup is what these latencies allow when nothing else costs time:
(generations x F_T + tokens x t_T(1)) / (generations x F + sum of the rounds' costs), F the method's
prefill extra (F_T + F_D for `sd`, `rsd_c` and `rsd_s`), which for a fixed K and long answers is
BE x t_T(1) / (t_T(K + 1) + K t_D). The measured speedup is lower by what the formula leaves out: the
engine's own work (acceptance, sampling, cache edits, controllers).

Chain rounds are timed as the decoders make them, one round after the other: the drafter's steps
right after the target's previous verification, then the verification. On a CPU a model's call is
slower right after the other model ran (its weights and activations are no longer in the CPU's caches):
with the demo's 24-layer target, the drafter's first step of a round took 0.41-0.51 ms against 0.26 ms
in a loop of its own steps, and a verification of 5 tokens 8-9% more after drafter steps than after
target steps (bench/results/demo_task.md). Timing the models apart would charge that to the engine.
The `ar` step likewise follows an untimed step of the target, as `ar` makes its steps: timed right
after the other probes' calls instead, it took 6.04 ms against 5.2-6.2 ms per call (prefills included)
in the same run's `ar` decoding, which put `sd` at 85% of a prediction it could not reach.
A tree verification is timed the same way, right after a drafter's root step and level calls of a
round, the drafters in turn over the repeats: timed on the target alone, size after size, the size of
10 took 14.41 ms against 15.01 ms (median) in the same run's `rsd_s` rounds (engine_overhead.md).

The prediction is a model, not a bound: latencies timed in a probe differ from those inside the decoding
(the shares of it reached were 86-108% over four runs of the same drafters, bench/results/demo_task.md),
so reports give its error, measured / predicted - 1, beside it.

For `eagle3` a round's first "drafter" step is the head's catch-up over the newest committed position (it
reads the target's features of the accepted tokens, one position in the timed round), the later ones a
head step each; its "target" call also returns the head's feature layers.

For `eesd` the "target" of a round is the early-exit verification (the shared layers on the last
draft, then the target's deeper layers on all k + 1 positions) and a "drafter" step one exit step (the
shared layers plus the exit layers), as `decoding.eesd` runs them.

Latencies are medians over repeats of the very calls the decoders make (`CachedLM.forward` then `crop`;
`SelfSpeculative.draft_step` / `verify` then `crop`), timed by the models' own forward clocks, on a
cache that holds a realistic context, which each model takes once. Every size of every model is
measured once per repeat, interleaved, so a slow spell of the machine hits them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from polydraft.decoding.lm import CachedLM
from polydraft.decoding.tree import TreeShape, tree_attention


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


def _check(context: Tensor, sizes: Sequence[int], repeats: int) -> None:
    if repeats < 1 or not sizes or max(sizes) >= context.shape[1] or min(sizes) < 1:
        raise ValueError(
            f"latency sizes must be in 1..{context.shape[1] - 1} and repeats >= 1, "
            f"got sizes {list(sizes)}, repeats {repeats}"
        )


def _prefill(lm: CachedLM, context: Tensor, tree_sizes: Sequence[int] = ()) -> int:
    """Put `context` in `lm`'s cache; its length."""
    lm.reset()
    lm.forward(context.to(lm.device))
    if tree_sizes and lm.window is not None and lm.length + max(tree_sizes) >= lm.window:
        lm.reset()
        raise NotImplementedError(
            f"tree calls after {context.shape[1]} positions exceed the model's sliding window ({lm.window})"
        )
    return lm.length


def _prefill_self_speculative(model, context: Tensor) -> int:
    model.reset()
    model.draft_step(context.to(model.device))
    model.verify(context[:, :0], 1)
    return context.shape[1]


def _timed(lm: CachedLM, input_ids: Tensor) -> float:
    """Seconds of one forward call of `lm` on `input_ids` (logits of every new position), by its own clock."""
    before = lm.seconds
    lm.forward(input_ids.to(lm.device), num_logits=input_ids.shape[1])
    return lm.seconds - before


AR_STEPS = 8
"""Consecutive `ar` steps a probe of the target's step averages: one step timed right after an untimed one
still cost 13-18% more than `ar`'s own steps in decoding, on two machines (bench/results/engine_overhead.md)."""


def _lm_once(
    lm: CachedLM,
    tokens: Tensor,
    length: int,
    chain_sizes: Sequence[int],
    tree_sizes: Sequence[int],
    warm: bool = False,
) -> Latencies:
    """One timing of each size after the `length` cached positions (cropped back after each). With
    `warm`, each chain size is timed the way `ar` makes its steps, one after the other and never right
    after another model: an untimed call, then the mean of `AR_STEPS` calls each appending to the cache
    (the tokens' values do not change a call's time)."""
    chain: dict[int, float] = {}
    tree: dict[int, float] = {}
    for n in chain_sizes:
        if warm:
            lm.forward(tokens[:, :n].to(lm.device), num_logits=n)
            chain[n] = sum(_timed(lm, tokens[:, :n]) for _ in range(AR_STEPS)) / AR_STEPS
        else:
            chain[n] = _timed(lm, tokens[:, :n])
        lm.crop(length)
    for n in tree_sizes:
        tree[n] = _tree_call(lm, tokens, n)
        lm.crop(length)
    return Latencies(chain, tree)


def _tree_call(lm: CachedLM, tokens: Tensor, n: int) -> float:
    """Seconds of one masked call of `lm` on n new tokens after its cached positions, a causal pattern
    given as the explicit additive mask with explicit positions (a chain is a tree of one child each)."""
    length = lm.length
    rows = torch.ones(n, n, dtype=torch.bool, device=lm.device).tril()
    mask = tree_attention(length, 0, rows, lm.dtype)
    positions = torch.arange(length, length + n, device=lm.device).view(1, -1)
    before = lm.seconds
    lm.forward(tokens[:, :n].to(lm.device), n, positions, mask)
    return lm.seconds - before


def _trees_once(
    target: CachedLM, drafter: CachedLM, tokens: Tensor, length: int, sizes: Sequence[int], levels: list[int]
) -> dict[int, float]:
    """Each tree verification size of the target right after a drafter's calls of a tree round (its root
    step, then one masked call per size in `levels`), as `tree_decode` makes them; both cropped back."""
    tree: dict[int, float] = {}
    for n in sizes:
        drafter.forward(tokens[:, :1].to(drafter.device))
        for size in levels:
            _tree_call(drafter, tokens, size)
        tree[n] = _tree_call(target, tokens, n)
        target.crop(length)
        drafter.crop(length)
    return tree


def _rounds(
    draft: Callable[[int], float], verify: Callable[[int], float], crop: Callable[[], None], max_drafts: int
) -> ChainRounds:
    """Rounds of k = 0..max_drafts drafts, one after the other: `draft(i)` times the round's step i
    (0-based), `verify(k)` the verification of k + 1 positions, `crop()` goes back to the context. A
    step's time is its mean over the rounds that take it."""
    verify_seconds: dict[int, float] = {}
    draft_seconds = [0.0] * max_drafts
    for k in range(max_drafts + 1):
        for i in range(k):
            draft_seconds[i] += draft(i) / (max_drafts - i)
        verify_seconds[k + 1] = verify(k)
        crop()
    return ChainRounds(verify_seconds, draft_seconds)


def _rounds_once(
    target: CachedLM, drafter: CachedLM, tokens: Tensor, length: int, max_drafts: int
) -> ChainRounds:
    """`sd`'s rounds after the `length` cached positions: k drafter calls on one token each, then the
    target on k + 1 tokens; both models cropped back after each round."""

    def crop() -> None:
        target.crop(length)
        drafter.crop(length)

    def draft(i: int) -> float:
        return _timed(drafter, tokens[:, i : i + 1])

    return _rounds(draft, lambda k: _timed(target, tokens[:, : k + 1]), crop, max_drafts)


def _self_speculative_once(model, tokens: Tensor, length: int, max_drafts: int) -> ChainRounds:
    """`eesd`'s rounds after the `length` cached positions: k exit steps on one token each, then the
    verification of k + 1 positions (the shared layers on the last draft, the deeper layers on all
    k + 1); every slot group cropped back after each round."""

    def draft(i: int) -> float:
        before = model.draft_seconds
        model.draft_step(tokens[:, i : i + 1])
        return model.draft_seconds - before

    def verify(k: int) -> float:
        before = model.target_seconds
        model.verify(tokens[:, k : k + 1], k + 1)
        return model.target_seconds - before

    return _rounds(draft, verify, lambda: model.crop(length, length), max_drafts)


def _prefill_eagle3(featured: CachedLM, drafter, context: Tensor) -> int:
    """The target's cache and the head's hold `context` (the head: every position but the last, whose
    feature the target's call on it gave); the context's length."""
    length = _prefill(featured, context)
    drafter.reset()
    assert featured.features is not None
    drafter.read(context[0, 1:].to(featured.device), featured.features[:-1])
    return length


def _eagle3_once(featured: CachedLM, drafter, tokens: Tensor, length: int, max_drafts: int) -> ChainRounds:
    """`eagle3`'s rounds after the `length` cached positions: the head's catch-up over the newest position
    and k - 1 head steps, then the target (with the feature layers) on k + 1 tokens; both cropped back."""
    assert featured.features is not None
    feature = featured.features[-1:]

    def draft(i: int) -> float:
        before = drafter.seconds
        if i == 0:
            drafter.read(tokens[0, :1], feature)
        else:
            drafter.step(tokens[0, i : i + 1])
        return drafter.seconds - before

    def crop() -> None:
        featured.crop(length)
        drafter.crop(length - 1)

    return _rounds(draft, lambda k: _timed(featured, tokens[:, : k + 1]), crop, max_drafts)


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


@torch.inference_mode()
def lm_latencies(
    lm: CachedLM, context: Tensor, chain_sizes: Sequence[int], tree_sizes: Sequence[int], repeats: int
) -> Latencies:
    """Latencies of `lm` on n new tokens after `context` [1, c] for each size (c must exceed every size).

    Tree calls use a causal pattern given as the explicit additive mask with explicit positions, the way
    `decoding.rsd` calls the models (a chain is a tree whose every node has one child)."""
    _check(context, [*chain_sizes, *tree_sizes], repeats)
    length = _prefill(lm, context, tree_sizes)
    tokens = context[:, 1:].to(lm.device)
    samples = [_lm_once(lm, tokens, length, chain_sizes, tree_sizes) for _ in range(repeats)]
    lm.reset()
    return _median_latencies(samples)


@torch.inference_mode()
def chain_round_latencies(
    target: CachedLM, drafter: CachedLM, context: Tensor, max_drafts: int, repeats: int
) -> ChainRounds:
    """`sd`'s rounds of k = 0..max_drafts drafts after `context` [1, c] (c > max_drafts + 1), repeated."""
    _check(context, [max_drafts + 1], repeats)
    length = _prefill(target, context)
    _prefill(drafter, context)
    tokens = context[:, 1:]
    samples = [_rounds_once(target, drafter, tokens, length, max_drafts) for _ in range(repeats)]
    target.reset()
    drafter.reset()
    return _median_rounds(samples)


@torch.inference_mode()
def self_speculative_latencies(model, context: Tensor, max_drafts: int, repeats: int) -> ChainRounds:
    """`eesd`'s rounds (a `decoding.eesd.SelfSpeculative`) of k = 0..max_drafts drafts after `context`."""
    _check(context, [max_drafts + 1], repeats)
    context = context.to(model.device)
    length = _prefill_self_speculative(model, context)
    samples = [_self_speculative_once(model, context[:, 1:], length, max_drafts) for _ in range(repeats)]
    model.reset()
    return _median_rounds(samples)


@dataclass(frozen=True)
class RunLatencies:
    """What a measure run's predicted speedups are computed from."""

    target: Latencies
    """The target's `ar` step, and every tree verification size (after a drafter's tree calls)."""
    drafters: dict[str, Latencies]
    """Standalone drafters alone, by name: one step, and every tree level size."""
    rounds: dict[str, ChainRounds]
    """Chain rounds by drafter name: `sd`'s for a standalone drafter, `eesd`'s for an early-exit one,
    `eagle3`'s for an EAGLE-3 head."""
    prefill: dict[str, float] = field(default_factory=dict)
    """The prompt's extra of each model's first call (F), `target` and by drafter name: a standalone
    drafter's alone, an early-exit drafter's and an EAGLE-3 head's with their target calls. Empty when the
    probes had no prompt."""

    def method_prefill(self, drafter: str | None = None, standalone: bool = False) -> float:
        """F of a method: the target's (`ar`, drafter None), the target's and a standalone drafter's, or
        an early-exit drafter's or EAGLE-3 head's own (0 when not timed)."""
        if drafter is None:
            return self.prefill.get("target", 0.0)
        if standalone:
            return self.prefill.get("target", 0.0) + self.prefill.get(drafter, 0.0)
        return self.prefill.get(drafter, 0.0)

    def as_json(self) -> dict:
        return {
            "target": self.target.as_json(),
            "drafters": {name: lat.as_json() for name, lat in self.drafters.items()},
            "rounds": {name: rounds.as_json() for name, rounds in self.rounds.items()},
            "prefill": dict(self.prefill),
        }


@torch.inference_mode()
def run_latencies(
    target: CachedLM,
    drafters: dict[str, CachedLM],
    self_speculative: dict[str, object],
    eagle3: dict[str, tuple[CachedLM, object]],
    context: Tensor,
    max_draft_length: int,
    shapes: Sequence[TreeShape],
    repeats: int,
    prompt: Tensor | None = None,
) -> RunLatencies:
    """Every latency the run's decoders need: the target's step (and every tree size), each standalone
    drafter's step (and every tree level), the chain rounds of up to max_draft_length drafts of each
    standalone and early-exit drafter and EAGLE-3 head (`eagle3`: name -> (the target with the head's
    feature layers, the head's `Eagle3Drafter`)). Each model takes the context once; then every probe runs once per
    repeat, in turn, so that a slow spell of the machine hits the `ar` step and the rounds it is
    compared with alike; medians over the repeats. With `prompt` [1, p], then each model's prompt extra F
    (`prefill_extras`), `repeats` times each."""
    max_nodes = max((shape.max_nodes for shape in shapes), default=0)
    levels = sorted({size for shape in shapes for size in shape.level_sizes(shape.depth)[:-1]})
    all_levels = list(range(1, max(levels) + 1)) if levels else []
    # the levels of a round of the first tree: what the drafter calls before the target's tree verification
    levels_of_round = shapes[0].level_sizes(shapes[0].depth)[:-1] if shapes else []
    tree_sizes = list(range(2, max_nodes + 2)) if shapes else []
    _check(context, [max_draft_length + 1, *tree_sizes], repeats)
    length = _prefill(target, context, tree_sizes)
    for lm in drafters.values():
        _prefill(lm, context, [*all_levels, 1 + sum(levels_of_round)] if levels_of_round else all_levels)
    for model in self_speculative.values():
        _prefill_self_speculative(model, context.to(model.device))
    for featured, head in eagle3.values():
        _prefill_eagle3(featured, head, context)
    tokens = context[:, 1:]
    target_samples: list[Latencies] = []
    drafter_samples: dict[str, list[Latencies]] = {name: [] for name in drafters}
    round_samples: dict[str, list[ChainRounds]] = {
        name: [] for name in [*drafters, *self_speculative, *eagle3]
    }
    standalone = list(drafters.values())
    for repeat in range(repeats):
        if shapes and standalone:  # tree sizes after a drafter's tree calls, the drafters in turn
            step = _lm_once(target, tokens.to(target.device), length, [1], [], warm=True)
            drafter = standalone[repeat % len(standalone)]
            trees = _trees_once(target, drafter, tokens, length, tree_sizes, levels_of_round)
            target_samples.append(Latencies(step.chain, trees))
        else:
            target_samples.append(
                _lm_once(target, tokens.to(target.device), length, [1], tree_sizes, warm=True)
            )
        for name, lm in drafters.items():
            drafter_samples[name].append(_lm_once(lm, tokens.to(lm.device), length, [1], all_levels))
            round_samples[name].append(_rounds_once(target, lm, tokens, length, max_draft_length))
        for name, model in self_speculative.items():
            eesd_tokens = tokens.to(model.device)
            round_samples[name].append(_self_speculative_once(model, eesd_tokens, length, max_draft_length))
        for name, (featured, head) in eagle3.items():
            head_tokens = tokens.to(featured.device)
            round_samples[name].append(_eagle3_once(featured, head, head_tokens, length, max_draft_length))
    rounds = {name: _median_rounds(samples) for name, samples in round_samples.items()}
    prefill = {}
    if prompt is not None:
        prefill = prefill_extras(target, drafters, self_speculative, eagle3, rounds, prompt, repeats)
    for lm in [
        target,
        *drafters.values(),
        *self_speculative.values(),
        *(m for pair in eagle3.values() for m in pair),
    ]:
        lm.reset()
    return RunLatencies(
        target=_median_latencies(target_samples),
        drafters={name: _median_latencies(samples) for name, samples in drafter_samples.items()},
        rounds=rounds,
        prefill=prefill,
    )


def _first_call_extra(lm: CachedLM, prompt: Tensor) -> float:
    """t(prompt) - t(1 token) of `lm` from an empty cache: its first call, then a step after it."""
    lm.reset()
    first = _timed(lm, prompt)
    return first - _timed(lm, prompt[:, -1:])


def prefill_extras(
    target: CachedLM,
    drafters: dict[str, CachedLM],
    self_speculative: dict[str, object],
    eagle3: dict[str, tuple[CachedLM, object]],
    rounds: dict[str, ChainRounds],
    prompt: Tensor,
    repeats: int,
) -> dict[str, float]:
    """F per model (medians over `repeats`, every model once per repeat): the target's and each
    standalone drafter's first call on `prompt` less a step; an early-exit drafter's and an EAGLE-3 head's
    whole prefill (as `_prefill_self_speculative` and `_prefill_eagle3` make it) less their round of one
    draft (their first round's draft step and verification of 2 positions stand in the rounds' costs)."""
    samples: dict[str, list[float]] = {"target": []}
    for _ in range(repeats):
        samples["target"].append(_first_call_extra(target, prompt.to(target.device)))
        for name, lm in drafters.items():
            samples.setdefault(name, []).append(_first_call_extra(lm, prompt.to(lm.device)))
        for name, model in self_speculative.items():
            clock = time.perf_counter()
            _prefill_self_speculative(model, prompt.to(model.device))
            whole = time.perf_counter() - clock
            samples.setdefault(name, []).append(whole - rounds[name].verify[2] - rounds[name].draft[0])
        for name, (featured, head) in eagle3.items():
            clock = time.perf_counter()
            _prefill_eagle3(featured, head, prompt.to(featured.device))
            whole = time.perf_counter() - clock
            samples.setdefault(name, []).append(whole - rounds[name].verify[2] - rounds[name].draft[0])
    return {name: statistics.median(values) for name, values in samples.items()}
