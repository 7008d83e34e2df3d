"""`rsd_c` and `rsd_s`: recursive speculative decoding with draft trees (seed 002 Alg. 2 and 7).

Each round (`decoding.tree.tree_decode`): grow the tree with the drafter (`decoding.tree.draft_tree`),
score the pending committed token(s) and every node in ONE target forward (tree mask + position ids,
head on the root and the nodes only), walk the tree with recursive rejection sampling level by level,
then keep only the accepted path in both caches (`CachedLM.keep`) and commit the path plus the final
token.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from polydraft.decoding.engine import Generation, Output, finish
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.tree import Tree, TreeShape, draft_tree, tree_decode


class DrafterTree:
    """`rsd_c` / `rsd_s`: the drafter grows the tree (`draft_tree` of `shape`), its cache follows the
    target's accepted path (`tree_decode`'s `TreeProposer`)."""

    def __init__(
        self,
        target: CachedLM,
        drafter: CachedLM,
        shape: TreeShape,
        sampling: Sampling,
        generator: torch.Generator,
    ) -> None:
        self.drafter, self.shape, self.sampling, self.generator = drafter, shape, sampling, generator
        self.models, self.max_nodes = [target, drafter], shape.max_nodes

    def max_depth(self) -> int:
        return self.shape.depth

    def draft(self, out: Output, depth: int) -> tuple[Tree, Tensor | None]:
        pending = out.pending(self.drafter.length)
        return draft_tree(self.drafter, pending, self.shape, depth, self.sampling, self.generator)

    def keep(self, n: int, tree: Tree | None, path: list[int], hidden: Tensor) -> None:
        if tree is not None:
            self.drafter.keep(n, [node for node in path if node < tree.fed])


@torch.inference_mode()
def recursive_speculative(
    target: CachedLM,
    drafter: CachedLM,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    shape: TreeShape,
    generator: torch.Generator,
    eos_ids: set[int],
) -> Generation:
    """Decode one prompt with `rsd_c` or `rsd_s` (by `shape.method`)."""
    start = time.perf_counter()
    target.reset()
    drafter.reset()
    out = Output(prompt.to(target.device), max_new_tokens, eos_ids, slack=shape.depth + 1)
    rounds = tree_decode(
        DrafterTree(target, drafter, shape, sampling, generator), target, out, sampling, generator
    )
    return finish(out, start, target, drafter, rounds)
