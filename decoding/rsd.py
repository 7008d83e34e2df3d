"""`rsd_c` and `rsd_s`: recursive speculative decoding with draft trees (seed 002 Alg. 2 and 7).

Each round: grow the tree with the drafter (`decoding.tree.draft_tree`), score the pending committed
token(s) and every node in ONE target forward (tree mask + position ids, head on the root and the
nodes only), walk the tree with recursive rejection sampling level by level, then keep only the
accepted path in both caches (`CachedLM.keep`) and commit the path plus the final token.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from polydraft.decoding.engine import Generation, Output, Round, finish, next_token
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling
from polydraft.decoding.tree import TreeShape, check_window, draft_tree, tree_inputs, verify_rows, verify_tree


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
    device = target.device
    out = Output(prompt.to(device), max_new_tokens, eos_ids, slack=shape.depth + 1)
    rounds: list[Round] = []
    while not out.done:
        n = out.length
        check_window([target, drafter], n, shape.max_nodes)
        depth = min(shape.depth, out.remaining - 1)
        pending = out.pending(target.length)
        if depth == 0:
            # one token left: a plain target step
            logits, _ = target.forward(pending)
            token = next_token(logits[-1], sampling, generator)
            out.commit([int(token)], token)
            rounds.append(Round(0, 0, 0))
            continue
        tree, draft_probs = draft_tree(
            drafter, out.pending(drafter.length), shape, depth, sampling, generator
        )
        size = len(tree)
        inputs, positions, mask = tree_inputs(target, pending, n, tree)
        logits, _ = target.forward(inputs, size + 1, positions, mask)
        path, token = verify_tree(
            tree, draft_probs, verify_rows(tree, logits, sampling), sampling.greedy, generator
        )
        target.keep(n, path)
        drafter.keep(n, [node for node in path if node < tree.fed])
        new = [tree.tokens[node] for node in path] + [token]
        kept = out.commit(new)
        rounds.append(Round(depth, size, min(len(path), kept)))
    return finish(out, start, target, drafter, rounds)
