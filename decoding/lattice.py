"""Blockwise drafts from proposal heads: Medusa candidate trees and the drafter-rescored top-k lattice.

The heads (`models.heads`) give, from one hidden state, independent distributions h_0..h_{m-1} for the
next m positions after the pending token. Two ways to turn them into drafts:

- a **candidate tree** (Medusa): a fixed set of rank paths, e.g. ((0,), (1,), (0, 0), (0, 1)), where a
  node at depth d with rank r holds the r-th token drawn for its parent from h_{d-1}. Greedy: the
  r-th most likely token. Sampling: each parent's children are drawn from h_{d-1} *without replacement*
  (Gumbel-top-k, independently per parent) in rank order, which is what recursive rejection sampling
  needs; the heads do not see the parent, so h_{d-1} is the exact distribution of every child at d.
- the **top-k lattice** rescored by a small drafter LM (local rescoring, Kim et al. 2024): position j
  offers the k most likely tokens of h_j; a path y_0..y_{L-1} through the lattice is drawn or ranked by
  r_j(y | y_<j) = softmax over the k candidates of [(1 - lambda) log h_j(y) + lambda log d(y | prefix, y_<j)],
  d being the drafter's distribution after the committed tokens and the path so far. lambda = 0 gives the
  heads alone (renormalised over the top k), lambda = 1 the drafter restricted to the lattice. A path's
  score is sum_j log r_j, the log-probability of drawing it. `rescorer` plugs r into `draft_tree`, whose
  beam search (`rsd_s` shape) then runs over the lattice: a plain beam search at temperature 0,
  stochastic beam search (sequences without replacement) when sampling.

At temperature > 0 the heads' and the drafter's distributions are the ones sampling uses (`probabilities`
for the heads, candidates outside top-k/top-p have probability 0), except that the drafter's top-k/top-p
filtering is not applied: it only reweights candidates the heads allow, and must not remove them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from polydraft.decoding.sampling import Sampling, gumbel_topk, probabilities
from polydraft.decoding.tree import Rescore, Tree


def head_log_probs(logits: Tensor, sampling: Sampling) -> Tensor:
    """The heads' log-distributions [m, V] drafts are drawn from (-inf where sampling gives probability 0)."""
    if sampling.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return probabilities(logits, sampling).log()


def drafter_log_probs(logits: Tensor, sampling: Sampling) -> Tensor:
    """The rescoring drafter's log-distributions: tempered, never truncated (see the module docstring)."""
    scale = 1.0 if sampling.greedy else sampling.temperature
    return torch.log_softmax(logits.float() / scale, dim=-1)


def rescorer(head_logp: Tensor, top_k: int, weight: float, sampling: Sampling) -> Rescore:
    """`draft_tree`'s rescoring for the lattice of `head_logp` [m, V]: level j's children come from r_j."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"the rescoring weight lambda must be in [0, 1], got {weight}")
    candidate_logp, candidates = head_logp.topk(min(top_k, head_logp.shape[-1]), dim=-1)

    def rescore(level: int, logits: Tensor) -> Tensor:
        tokens, heads = candidates[level], candidate_logp[level]
        valid = heads > float("-inf")
        drafter = drafter_log_probs(logits, sampling)[:, tokens]  # [F, k]
        mixed = torch.where(valid, (1.0 - weight) * heads.clamp(min=-1e30) + weight * drafter, float("-inf"))
        out = torch.full(logits.shape, float("-inf"), device=logits.device)
        out[:, tokens] = torch.log_softmax(mixed, dim=-1)
        return out

    return rescore


def best_path(tree: Tree) -> list[int]:
    """The nodes from the root to the first node of the deepest level (a beam search's best final beam)."""
    deepest = max(tree.depths)
    node = tree.depths.index(deepest)
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


@dataclass(frozen=True)
class CandidateTree:
    """A Medusa tree: rank paths, each path's prefixes present, each node's child ranks 0..c-1."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def from_paths(cls, paths: list[list[int]] | list[tuple[int, ...]]) -> CandidateTree:
        ordered = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        if not ordered or min(len(p) for p in ordered) < 1 or min(min(p) for p in ordered) < 0:
            raise ValueError(f"a candidate tree needs non-empty rank paths of ranks >= 0, got {paths}")
        present = set(ordered)
        for path in ordered:
            if len(path) > 1 and path[:-1] not in present:
                raise ValueError(f"candidate tree path {list(path)} has no parent path {list(path[:-1])}")
            if path[-1] > 0 and (*path[:-1], path[-1] - 1) not in present:
                raise ValueError(
                    f"candidate tree path {list(path)}: rank {path[-1] - 1} is missing before it"
                )
        return cls(tuple(ordered))

    @classmethod
    def chain(cls, depth: int) -> CandidateTree:
        return cls.from_paths([[0] * d for d in range(1, depth + 1)])

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    def within(self, depth: int) -> tuple[tuple[int, ...], ...]:
        return tuple(p for p in self.paths if len(p) <= depth)


def candidate_tree(
    head_logp: Tensor, shape: CandidateTree, depth: int, sampling: Sampling, generator: torch.Generator
) -> tuple[Tree, Tensor | None]:
    """The tree of `shape`'s paths up to `depth` levels (see the module docstring).

    Returns it and, when sampling, the distributions children were drawn from [1 + N, V] (row 0 at the
    root, row i + 1 at node i: h_{depth(i)}, clamped to the last head for leaves, whose row is unused).
    A child whose draw does not exist (fewer tokens of non-zero probability than its rank) is left out
    with its subtree.
    """
    device = head_logp.device
    paths = shape.within(depth)
    node_of: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    noise = None if sampling.greedy else generator
    for level in range(1, depth + 1):
        level_paths = [p for p in paths if len(p) == level and (level == 1 or p[:-1] in node_of)]
        if not level_paths:
            break
        parent_ids = sorted({node_of[p[:-1]] if level > 1 else -1 for p in level_paths})
        width = max(p[-1] for p in level_paths) + 1
        rows = head_logp[level - 1].expand(len(parent_ids), -1)
        drawn, valid = gumbel_topk(rows, min(width, rows.shape[-1]), noise)
        drawn, valid = drawn.tolist(), valid.tolist()
        for path in level_paths:
            parent = node_of[path[:-1]] if level > 1 else -1
            row, rank = parent_ids.index(parent), path[-1]
            if rank < len(drawn[row]) and valid[row][rank]:
                node_of[path] = len(tokens)
                tokens.append(drawn[row][rank])
                parents.append(parent)
                depths.append(level)
    tree = Tree(tokens, parents, depths, fed=0)
    if sampling.greedy:
        return tree, None
    rows = torch.tensor([0, *depths], device=device).clamp(max=head_logp.shape[0] - 1)
    return tree, head_logp.exp()[rows]
