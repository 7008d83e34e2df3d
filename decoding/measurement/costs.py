"""The latency model's costs: what a round costs and the speedup predicted over a set of generations,
from the latencies `decoding.measurement.latency` times (its docstring gives the model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from polydraft.decoding.engine import Generation, Round
from polydraft.decoding.measurement.latency import ChainRounds, Latencies
from polydraft.decoding.tree import TreeShape

RoundCost = Callable[[Round], float]


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


def predicted_speedup(
    generations: Sequence[Generation],
    target_step: float,
    cost: RoundCost,
    prefill: float = 0.0,
    ar_prefill: float = 0.0,
) -> float | None:
    """(generations x `ar_prefill` + tokens x t_T(1)) / (generations x `prefill` + sum of the rounds'
    costs) over these generations (None without rounds): `prefill` is the method's extra for its first
    calls on a prompt, `ar_prefill` the target's (F_T)."""
    rounds = [r for g in generations for r in g.rounds]
    if not rounds:
        return None
    tokens = sum(len(g.tokens) for g in generations)
    count = len(generations)
    return (count * ar_prefill + tokens * target_step) / (count * prefill + sum(cost(r) for r in rounds))
