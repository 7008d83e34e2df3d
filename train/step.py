"""One optimizer step over micro-batches, and its logging: shared by the drafter and early-exit trainers.

`train_step` gives the exact mean loss over the loss-carrying tokens of the whole global batch (every
micro-batch of every process), whatever the gradient-accumulation split or the number of processes: each
micro-batch's loss is a sum (`train.losses`), scaled by the step's global token count before backward.
It clips the gradient by global norm, steps the optimizer and the LR scheduler once, and returns what the
step did. `StepLog` writes the per-step log and sends windowed means, tokens/s and MFU to the tracker.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polydraft.train.losses import IGNORE_INDEX, scale_for_step
from polydraft.train.steplog import append_log
from polydraft.train.throughput import Throughput, mfu


@dataclass(frozen=True)
class OptimSettings:
    """AdamW and its schedule, as plain values (a stage builds this from its recipe block)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    warmup_ratio: float
    schedule: str
    min_lr_ratio: float
    max_grad_norm: float
    """0 disables clipping (the norm is still measured and logged)."""


@dataclass(frozen=True)
class StepStats:
    loss: float
    """Mean loss over the step's loss-carrying tokens, all micro-batches and processes."""
    lr: float
    """The learning rate the step used."""
    grad_norm: float
    loss_tokens: int
    input_tokens: int
    """Non-padding tokens of the global batch."""


def token_counts(micro_batches: list[dict[str, torch.Tensor]], accelerator: Any) -> tuple[int, int]:
    """(loss-carrying, input) tokens of the global batch: this process's micro-batches, summed over processes.

    A token carries loss when its label is not ignored and a position before it predicts it (t >= 1).
    """
    local = torch.tensor(
        [
            sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches),
            sum(int(b["attention_mask"].sum()) for b in micro_batches),
        ],
        device=accelerator.device,
    )
    loss_tokens, input_tokens = accelerator.reduce(local, "sum").tolist()
    return int(loss_tokens), int(input_tokens)


def train_step(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    micro_batches: list[dict[str, torch.Tensor]],
    loss_sum: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    max_grad_norm: float,
) -> StepStats:
    """One optimizer step: `loss_sum(batch)` is a micro-batch's summed loss; gradients accumulate over
    the micro-batches (accelerate syncs them on the last), are clipped at `max_grad_norm` (0: never), and
    the optimizer and scheduler step once."""
    loss_tokens, input_tokens = token_counts(micro_batches, accelerator)
    scale = scale_for_step(loss_tokens, accelerator.num_processes, accelerator.gradient_accumulation_steps)
    clip = max_grad_norm or float("inf")
    total = torch.zeros((), device=accelerator.device)
    grad_norm = None
    for batch in micro_batches:
        with accelerator.accumulate(model):
            loss = loss_sum(batch)
            accelerator.backward(loss * scale)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        total += loss.detach()
    step_loss = accelerator.reduce(total, "sum").item() / max(loss_tokens, 1)
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    return StepStats(
        loss=step_loss,
        lr=lr,
        grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
        loss_tokens=loss_tokens,
        input_tokens=input_tokens,
    )


class StepLog:
    """The per-step log file (main process) and the tracker's windowed training metrics.

    Every `log_every` steps (and at the last) the tracker gets `<prefix>train/loss` (mean over the window),
    `lr`, `grad_norm`, `tokens` (input tokens seen), `tokens_per_s` (per process) and `mfu` (on a GPU
    whose peak is known, with `flops_per_token` the FLOPs of one trained token).
    """

    def __init__(
        self,
        tracker: Any,
        log_path: Path,
        *,
        prefix: str,
        log_every: int,
        flops_per_token: float,
        peak_flops: float | None,
        world: int,
        main_process: bool,
        step_offset: int = 0,
    ):
        self.tracker, self.log_path, self.prefix = tracker, log_path, prefix
        self.log_every, self.flops_per_token, self.peak = log_every, flops_per_token, peak_flops
        self.world, self.main_process, self.step_offset = world, main_process, step_offset
        self.throughput, self.window = Throughput(), []

    def record(
        self, step: int, total_steps: int, stats: StepStats, tokens_seen: int
    ) -> dict[str, float] | None:
        """Log step `step`; at a logging step, return the window's metrics (unprefixed), else None."""
        self.throughput.add(stats.input_tokens)
        self.window.append(stats.loss)
        if self.main_process:
            append_log(
                self.log_path,
                {
                    "step": step,
                    "loss": stats.loss,
                    "lr": stats.lr,
                    "grad_norm": stats.grad_norm,
                    "tokens": tokens_seen,
                },
            )
        if step % self.log_every and step != total_steps:
            return None
        tokens_per_s = self.throughput.rate()
        metrics = {
            "train/loss": sum(self.window) / len(self.window),
            "train/lr": stats.lr,
            "train/grad_norm": stats.grad_norm,
            "train/tokens": tokens_seen,
            "train/tokens_per_s": tokens_per_s,
        }
        utilisation = mfu(tokens_per_s / self.world, self.flops_per_token, self.peak)
        if utilisation is not None:
            metrics["train/mfu"] = utilisation
        self.window = []
        if self.main_process:
            prefixed = {self.prefix + k: v for k, v in metrics.items()}
            self.tracker.log(prefixed, step=self.step_offset + step, echo=False)  # the loop shows a line
        return metrics
