"""AdamW and the learning-rate schedule every trainer uses: linear warmup, then cosine (or linear) decay.

Seed 003 App. F.3 trains with AdamW and a cosine schedule with a warmup ratio of 0.03; seed 001 Table 9
uses the same shape. The schedule is a pure function of the optimizer step, so a resumed run gets the
same learning rates as an uninterrupted one.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("cosine", "linear", "constant")


def warmup_steps_for(total_steps: int, warmup_ratio: float) -> int:
    """Warmup length in optimizer steps: `ceil(ratio * total)`, so any positive ratio warms up at least one step."""
    return math.ceil(warmup_ratio * total_steps)


def lr_multiplier(
    step: int, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Fraction of the peak learning rate used for optimizer step `step` (0-based).

    Warmup rises linearly from 1/warmup to 1 (never 0: a first step at lr 0 would be wasted); the decay
    then goes from 1 down to `min_lr_ratio` at the last step.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norm weights (1-D tensors) get no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    # the fused kernel is much faster on a GPU and not available for CPU tensors everywhere
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_ratio: float,
    schedule: str,
    min_lr_ratio: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepping once per optimizer step (call `.step()` after `optimizer.step()`)."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be at least 1, got {total_steps}")
    warmup = warmup_steps_for(total_steps, warmup_ratio)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, warmup, schedule, min_lr_ratio)
    )
