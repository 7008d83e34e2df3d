"""EAGLE-3 heads fitted to a target's own greedy continuations, shared by the eagle3 decoding tests."""

from __future__ import annotations

import torch

from polydraft.models.eagle3 import Eagle3Head, head_for_target
from polydraft.train.chunked_loss import model_head
from polydraft.train.eagle3 import Unroll, ttt_losses


def fit_eagle3(
    target: torch.nn.Module,
    aux_layers: list[int],
    sequences: list[torch.Tensor],
    steps: int,
    draft_ids: torch.Tensor | None = None,
    lr: float = 1e-2,
    ttt_steps: int = 3,
    seed: int = 0,
) -> Eagle3Head:
    """A head trained a few full-batch Adam steps by the trainer's own training-time-test loss on
    `sequences` (every position carries loss), so that its drafts are accepted, partly. `draft_ids`:
    its draft vocabulary (default: the whole vocabulary)."""
    vocab = target.config.get_text_config().vocab_size
    torch.manual_seed(seed)
    head = head_for_target(
        target, draft_ids if draft_ids is not None else torch.arange(vocab), aux_layers, seed=seed
    )
    unroll = Unroll(head, ttt_steps)
    teacher = model_head(target.get_output_embeddings(), target.config)
    batches = [{"input_ids": s.view(1, -1), "attention_mask": torch.ones(1, len(s), dtype=torch.long),
                "labels": s.view(1, -1)} for s in sequences]  # fmt: skip
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        loss = sum(ttt_losses(unroll, unroll, teacher, target, batch, None)[0].sum() for batch in batches)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()
