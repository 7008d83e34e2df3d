"""Proposal heads fitted to a target's own greedy continuations, shared by the blockwise tests."""

from __future__ import annotations

import torch

from polydraft.models.heads import Heads, heads_for_target


def fit_heads(
    target,
    kind: str,
    num_heads: int,
    sequences: list[torch.Tensor],
    steps: int,
    lr: float = 3e-2,
    seed: int = 0,
) -> Heads:
    """Heads trained a few full-batch Adam steps on the target's hidden states of `sequences` (head i
    learns token t+2+i), so that their drafts are accepted, partly."""
    torch.manual_seed(seed)
    heads = heads_for_target(target, kind, num_heads)
    shared = target.get_output_embeddings() if kind == "bpd" else None
    with torch.no_grad():
        hidden = [target.model(s.view(1, -1)).last_hidden_state[0] for s in sequences]
    optimizer = torch.optim.Adam(heads.parameters(), lr=lr)
    for _ in range(steps):
        loss = torch.zeros(())
        for h, s in zip(hidden, sequences):
            logits = heads(h, shared)
            for i in range(num_heads):
                loss = loss + torch.nn.functional.cross_entropy(logits[i, : len(s) - 2 - i], s[2 + i :])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return heads.eval()
