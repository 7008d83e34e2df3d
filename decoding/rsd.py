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

from decoding.engine import Generation, Output, Round, finish, next_token
from decoding.lm import CachedLM
from decoding.sampling import Sampling
from decoding.tree import TreeShape, draft_tree, tree_attention, verify_rows, verify_tree


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
    windows = [w for w in (target.window, drafter.window) if w is not None]
    while not out.done:
        n = out.length
        if windows and n + shape.max_nodes >= min(windows):
            # sliding-window layers past their window see only recent positions: the tree mask cannot apply
            raise NotImplementedError(
                f"tree decoding needs the sequence and its draft tree ({n} + {shape.max_nodes} positions) "
                f"within the models' sliding window ({min(windows)}); use `sd` for longer outputs"
            )
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
        cached = target.length
        assert tree.ancestors is not None
        mask = tree_attention(cached, pending.shape[1], tree.ancestors, target.dtype)
        positions = torch.cat(
            [
                torch.arange(cached, n, device=device),
                torch.tensor(tree.depths, device=device) + (n - 1),
            ]
        ).view(1, -1)
        nodes = torch.tensor(tree.tokens, device=device).view(1, -1)
        logits, _ = target.forward(torch.cat([pending, nodes], dim=1), size + 1, positions, mask)
        path, token = verify_tree(
            tree, draft_probs, verify_rows(tree, logits, sampling), sampling.greedy, generator
        )
        target.keep(n, path)
        drafter.keep(n, [node for node in path if node < tree.fed])
        new = [tree.tokens[node] for node in path] + [token]
        kept = out.commit(new)
        rounds.append(Round(depth, size, min(len(path), kept)))
    return finish(out, start, target, drafter, rounds)
