"""Draft-token trees sampled without replacement, their attention masks, and their verification (seed 002 §3, App. B).

A tree hangs below the root, the last committed token. Its nodes are stored flat, level by level
(level l holds the tokens at depth l), each with the index of its parent node (-1 for the root); the
children of one node keep the order in which they were drawn, which is what recursive rejection
sampling needs. Two ways to grow it, one drafter forward per level for all nodes of the level:
- `rsd_c`: constant branching factors b = (b_0, ..., b_{L-1}); every node of level l gets b_l children
  drawn with Gumbel-top-k from p(.|node) (Alg. 3-4);
- `rsd_s`: stochastic beam search with beamwidth W (Alg. 8-9): each level keeps the W (parent, token)
  pairs with the largest truncated perturbed sequence log-probabilities.
At temperature 0 the draws become deterministic: the top-b tokens by logit (`rsd_c`) and a plain beam
search on the drafter's log-softmax (`rsd_s`); verification then accepts a child only when it is the
target's argmax, so the output is `ar`'s.

Attention: a node sees every committed position and its own ancestors (Alg. 5, where a child's mask
row is its parent's row plus itself); it sits at position (root position + depth).

`tree_decode` is the round every tree decoder shares (`rsd_c` / `rsd_s` with a drafter's tree, `medusa`
and `medusa+rescore` with the heads'): grow the tree (a `TreeProposer`), score the pending committed
token(s) and every node in one target forward, walk the tree, keep the accepted path in every cache and
commit it with the target's next token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from polydraft.decoding.engine import Output, Round, next_token
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import (
    Sampling,
    gumbel_topk,
    probabilities,
    recursive_rejection,
    stochastic_beam_step,
)


@dataclass
class Tree:
    """Flat draft-token tree: node i has token tokens[i], parent parents[i] (-1: root), depth depths[i]."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    fed: int = 0
    """Nodes processed by the drafter (all levels but the last); their p(.|node) rows exist."""

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[int, list[int]]:
        """Node -> its children in draw order (the root is -1)."""
        result: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents):
            result.setdefault(parent, []).append(node)
        return result


def ancestor_mask(
    parents: list[int], rows: Iterable[int], device: torch.device, columns: list[int] | None = None
) -> Tensor:
    """[len(rows), len(columns)] bool over the nodes of `parents` (each node's parent comes before it, -1:
    the root): entry (r, c) when node columns[c] is node rows[r] or one of its ancestors (seed 002 Alg. 5: a
    node's row is its parent's plus itself). `columns` defaults to every node in order; the target's
    verification gives its input order (`target_order`) for both.

    Built in Python, once per call: a tree is a few nodes, and a tensor op per node would cost more."""
    lineage: list[set[int]] = []
    for node, parent in enumerate(parents):
        lineage.append((lineage[parent] if parent >= 0 else set()) | {node})
    columns = list(range(len(parents))) if columns is None else columns
    marks = [[j in lineage[i] for j in columns] for i in rows]
    return torch.tensor(marks, dtype=torch.bool, device=device).reshape(len(marks), len(columns))


def tree_attention(num_cached: int, num_pending: int, tree_rows: Tensor, dtype: torch.dtype) -> Tensor:
    """The 4D additive mask for [pending chain tokens, then tree nodes] after `num_cached` positions.

    Pending tokens attend causally; tree rows attend to the cache, all pending tokens and the tree
    nodes marked in `tree_rows` [R, N] (their ancestors-or-self among the N nodes in the cache/input).
    """
    rows, nodes = tree_rows.shape
    prefix = num_cached + num_pending
    device, low = tree_rows.device, torch.finfo(dtype).min
    # built additive in place, in few calls: a round builds one for every tree level
    mask = torch.zeros(num_pending + rows, prefix + nodes, dtype=dtype, device=device)
    if num_pending:  # pending token i sees the cache and pending tokens 0..i, no tree node
        later = torch.ones(num_pending, num_pending + nodes, dtype=torch.bool, device=device).triu(1)
        mask[:num_pending, num_cached:].masked_fill_(later, low)
    mask[num_pending:, prefix:].masked_fill_(~tree_rows, low)
    return mask.view(1, 1, *mask.shape)


def check_window(models: list[CachedLM], length: int, nodes: int) -> None:
    """Refuse a tree that would reach past a sliding window: layers past their window see only recent
    positions, where the tree mask cannot apply."""
    windows = [model.window for model in models if model.window is not None]
    if windows and length + nodes >= min(windows):
        raise NotImplementedError(
            f"tree decoding needs the sequence and its draft tree ({length} + {nodes} positions) "
            f"within the models' sliding window ({min(windows)}); use `sd` for longer outputs"
        )


def target_order(tree: Tree) -> list[int]:
    """The order the target reads the nodes in (input slot -> node): first the chain of first children
    from the root (each node's first draw: its likeliest child, which verification tries first), then
    every other node level by level. An accepted path is most often a prefix of that chain, and the
    target's cache then keeps it by a crop, which on a deep target costs a quarter of moving the path's
    positions into place (`CachedLM.keep`). A path leaving the chain still has increasing slots: the
    chain's first, then the other nodes by depth."""
    children = tree.children()
    chain, node = [], -1
    while node in children:
        node = children[node][0]
        chain.append(node)
    on_chain = set(chain)
    return chain + [node for node in range(len(tree)) if node not in on_chain]


def tree_inputs(
    target: CachedLM, pending: Tensor, length: int, tree: Tree, order: list[int]
) -> tuple[Tensor, Tensor, Tensor]:
    """(input ids, position ids, attention mask) scoring the pending tokens and every node in one forward,
    the nodes in `order` (slot -> node, `target_order`).

    `length` is the committed length; node i sits at position length - 1 + depth (the root is the last
    committed token).
    """
    device, cached = target.device, target.length
    mask = tree_attention(
        cached, pending.shape[1], ancestor_mask(tree.parents, order, device, order), target.dtype
    )
    # one tensor per input, from Python lists: a tree is a few nodes
    places = [*range(cached, length), *((length - 1) + tree.depths[node] for node in order)]
    positions = torch.tensor(places, device=device).view(1, -1)
    nodes = torch.tensor([tree.tokens[node] for node in order], device=device).view(1, -1)
    return torch.cat([pending, nodes], dim=1), positions, mask


@dataclass(frozen=True)
class TreeShape:
    """`rsd_c`: `branching` = b (depth len(b)); `rsd_s`: `beam_width` W and `depth` L."""

    method: str
    depth: int
    branching: tuple[int, ...] = ()
    beam_width: int = 0

    @classmethod
    def constant(cls, branching: list[int]) -> TreeShape:
        if not branching or min(branching) < 1:
            raise ValueError(f"branching factors must be >= 1, got {branching}")
        return cls("rsd_c", len(branching), tuple(branching))

    @classmethod
    def beam(cls, width: int, depth: int) -> TreeShape:
        if width < 1 or depth < 1:
            raise ValueError(f"beam width and depth must be >= 1, got {width}, {depth}")
        return cls("rsd_s", depth, beam_width=width)

    @property
    def max_nodes(self) -> int:
        return sum(self.level_sizes(self.depth))

    def level_sizes(self, depth: int) -> list[int]:
        """Nodes per level of a full tree grown `depth` <= self.depth levels deep."""
        if self.method == "rsd_s":
            return [self.beam_width] * depth
        sizes, level = [], 1
        for b in self.branching[:depth]:
            level *= b
            sizes.append(level)
        return sizes


Rescore = Callable[[int, Tensor], Tensor]
"""(level, drafter logits [F, V] of the level's parents) -> the log-probabilities [F, V] their children are
drawn from (`decoding.lattice`: the drafter's rescoring of a blockwise lattice)."""


def _log_dist(
    logits: Tensor, sampling: Sampling, level: int, rescore: Rescore | None
) -> tuple[Tensor, Tensor | None]:
    """(log-probabilities used to draw children, probabilities used to verify; None when greedy)."""
    if rescore is not None:
        log_p = rescore(level, logits)
        return log_p, (None if sampling.greedy else log_p.exp())
    if sampling.greedy:
        return torch.log_softmax(logits.float(), dim=-1), None
    probs = probabilities(logits, sampling)
    return probs.log(), probs


def draft_tree(
    drafter: CachedLM,
    pending: Tensor,
    shape: TreeShape,
    depth: int,
    sampling: Sampling,
    generator: torch.Generator,
    rescore: Rescore | None = None,
) -> tuple[Tree, Tensor | None]:
    """Grow a tree of `depth` <= shape.depth levels below the last pending token.

    Returns the tree and, when sampling, the distributions its children were drawn from [1 + tree.fed, V]:
    row 0 at the root, row i + 1 at node i. They are the drafter's own, or what `rescore` makes of
    them. The drafter's cache ends with the pending tokens and the fed nodes.
    """
    device = drafter.device
    noise = None if sampling.greedy else generator
    logits, _ = drafter.forward(pending)
    log_p, probs = _log_dist(logits, sampling, 0, rescore)
    dists = [probs] if probs is not None else []
    committed = drafter.length
    # the tree's structure in Python lists: a level is a few nodes, and a tensor op per edit would cost
    # more than the lists
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    frontier = [-1]  # node ids of the current level
    sum_log_p = gamma = torch.zeros(1, device=device)
    for level in range(depth):
        if shape.method == "rsd_c":
            b = shape.branching[level]
            drawn, valid = gumbel_topk(log_p, min(b, log_p.shape[-1]), noise)
            chosen = [
                (parent, token)
                for parent, row, kept in zip(frontier, drawn.tolist(), valid.tolist(), strict=True)
                for token, ok in zip(row, kept, strict=True)
                if ok
            ]
        else:
            rows, drawn, sum_log_p, gamma = stochastic_beam_step(
                log_p, sum_log_p, gamma, shape.beam_width, noise
            )
            chosen = [(frontier[row], token) for row, token in zip(rows, drawn, strict=True)]
        size = len(tokens)
        for parent, token in chosen:
            tokens.append(token)
            parents.append(parent)
            depths.append(level + 1)
        frontier = list(range(size, len(tokens)))
        if level == depth - 1:
            break
        # the new level sees the committed positions and its ancestors among the nodes so far
        mask = tree_attention(committed, 0, ancestor_mask(parents, frontier, device), drafter.dtype)
        positions = torch.full((1, len(frontier)), committed + level, dtype=torch.long, device=device)
        level_tokens = torch.tensor(tokens[size:], dtype=torch.long, device=device).view(1, -1)
        logits, _ = drafter.forward(level_tokens, len(frontier), positions, mask)
        log_p, probs = _log_dist(logits, sampling, level + 1, rescore)
        if probs is not None:
            dists.append(probs)
    tree = Tree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        fed=len(tokens) - len(frontier),
    )
    return tree, (torch.cat(dists) if dists else None)


def verify_tree(
    tree: Tree, draft_probs: Tensor | None, target_out: Tensor, greedy: bool, generator: torch.Generator
) -> tuple[list[int], int]:
    """Walk the tree level by level (seed 002 Alg. 6): returns (accepted node path, next token).

    target_out is the target's argmax [1 + N] (greedy) or distribution [1 + N, V] (sampling), row 0 at
    the root and row i + 1 at node i; draft_probs the drafter's distributions at the root and fed nodes.
    """
    children = tree.children()
    path: list[int] = []
    node = -1
    if greedy:
        best = target_out.tolist()
        while True:
            want = best[node + 1]
            match = [c for c in children.get(node, []) if tree.tokens[c] == want]
            if not match:
                return path, want
            node = match[0]
            path.append(node)
    assert draft_probs is not None
    while True:
        kids = children.get(node, [])
        q = target_out[node + 1]
        p = draft_probs[node + 1] if kids else q
        index, token = recursive_rejection([tree.tokens[c] for c in kids], p, q, generator)
        if index is None:
            return path, token
        node = kids[index]
        path.append(node)


def verify_rows(logits: Tensor, rows: list[int], sampling: Sampling) -> Tensor:
    """What `verify_tree` reads from the target's logits [1 + N, V], in node order: row 0 at the root, row
    i + 1 at node i, taken from the logits' row rows[i + 1]. Greedy decoding reorders the argmax, not the
    logits: a [1 + N] vector against 1 + N rows of the vocabulary."""
    out = logits.argmax(-1) if sampling.greedy else probabilities(logits, sampling)
    if rows == list(range(len(rows))):
        return out
    return out.index_select(0, torch.tensor(rows, device=out.device))


class TreeProposer(Protocol):
    """Who grows the draft tree and which caches follow the target's, for one sequence (`tree_decode`)."""

    models: list[CachedLM]
    """The caches a round writes to (the target's first): each must hold `max_nodes` more positions."""
    max_nodes: int

    def max_depth(self) -> int:
        """Levels the next round may draft (0: a plain target step, e.g. before any target state)."""
        ...

    def draft(self, out: Output, depth: int) -> tuple[Tree, Tensor | None]:
        """A tree of up to `depth` levels below `out`'s last committed token and, when sampling, the
        distributions its children were drawn from (`draft_tree`'s)."""
        ...

    def keep(self, n: int, tree: Tree | None, path: list[int], hidden: Tensor) -> None:
        """After the target's call at length `n` (on `tree`, None for a plain step) accepted the nodes
        `path`: drop the rest from the proposer's caches; `hidden` [H] is the call's final hidden state at
        the path's last node (at the root when the path is empty; at the newest token after a plain step)."""
        ...


def tree_decode(
    proposer: TreeProposer, target: CachedLM, out: Output, sampling: Sampling, generator: torch.Generator
) -> list[Round]:
    """Run tree rounds until `out` is done; returns them."""
    rounds: list[Round] = []
    while not out.done:
        n = out.length
        check_window(proposer.models, n, proposer.max_nodes)
        depth = min(proposer.max_depth(), out.remaining - 1)
        pending = out.pending(target.length)
        if depth <= 0:  # nothing to draft from yet, or one token left: a plain target step
            logits, hidden = target.forward(pending)
            token = next_token(logits[-1], sampling, generator)
            proposer.keep(n, None, [], hidden[-1])
            out.commit([int(token)], token)
            rounds.append(Round(0, 0, 0))
            continue
        tree, draft_probs = proposer.draft(out, depth)
        order = target_order(tree)
        inputs, positions, mask = tree_inputs(target, pending, n, tree, order)
        logits, hidden = target.forward(inputs, len(tree) + 1, positions, mask)
        slot = [0] * len(tree)  # node -> input slot; the call's row 0 is the root's, row 1 + slot[i] node i's
        for index, node in enumerate(order):
            slot[node] = index
        rows = [0] + [1 + index for index in slot]
        path, token = verify_tree(
            tree, draft_probs, verify_rows(logits, rows, sampling), sampling.greedy, generator
        )
        target.keep(n, [slot[node] for node in path])
        proposer.keep(n, tree, path, hidden[rows[path[-1] + 1] if path else 0])
        kept = out.commit([tree.tokens[node] for node in path] + [token])
        rounds.append(Round(depth, len(tree), min(len(path), kept)))
    return rounds
