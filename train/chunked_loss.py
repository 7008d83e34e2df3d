"""The output head's loss computed chunk by chunk, so that the logits of a whole batch never exist at once.

With a 256k vocabulary (Gemma) the logits dwarf everything else a small drafter or an exit head holds:
4,096 tokens give a [4096, 256000] fp32 tensor of 4 GiB, and `ce_sum`'s backward holds it two or three
times over (the logits, their log-softmax, the gradient). Here only the positions that carry loss are
projected, a chunk of `chunk_tokens` rows at a time, each chunk under `torch.utils.checkpoint`: forward
keeps only the chunk's scalar loss (and its input rows), backward recomputes one chunk's logits at a time.
The loss and the gradients are those of `losses.ce_sum` / `losses.topk_kl_sum` on the full logits (same
fp32 arithmetic, summed in another order); the price is one more head matmul per chunk in backward.

Labels follow `train.losses` (Hugging Face convention: the hidden state at t predicts the label at t + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from polydraft.train.losses import IGNORE_INDEX, teacher_top_k, topk_kl_terms


@dataclass(frozen=True)
class OutputHead:
    """What turns final hidden states into logits, as the model's own forward does: the lm head's weight
    [V, H] and bias, then the final soft-capping of Gemma 2 (`tanh(logits / cap) * cap`) when set."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def model_head(lm_head: torch.nn.Module, config: Any | None) -> OutputHead:
    """The OutputHead of a transformers causal LM: its lm head (tied or not: the module holds the weight
    in use) and the config's `final_logit_softcapping` (None: plain logits, as an exit or Medusa head).

    ValueError for a family that scales its logits (Cohere's `logit_scale`, Granite's `logits_scaling`):
    the chunked loss would silently train another model."""
    softcap = None
    if config is not None:
        text = config.get_text_config(decoder=True)
        softcap = getattr(text, "final_logit_softcapping", None)
        for key in ("logit_scale", "logits_scaling"):
            if getattr(text, key, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"{type(config).__name__} scales its logits ({key}); the chunked loss does not: set "
                    "loop.loss_chunk_tokens to null for this model"
                )
    return OutputHead(lm_head.weight, getattr(lm_head, "bias", None), softcap)


@dataclass(frozen=True)
class Teacher:
    """The KL term's teacher: its final hidden states [B, T, H] at the student's positions (no autograd),
    its head, how many of its tokens to keep (`losses.topk_kl_sum`) and the term's weight."""

    hidden: torch.Tensor
    head: OutputHead
    top_k: int
    weight: float


def _chunk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    targets: torch.Tensor,
    teacher_top: torch.Tensor | None,
    indices: torch.Tensor | None,
    kl_weight: float,
) -> torch.Tensor:
    logits = OutputHead(weight, bias, softcap).logits(hidden).float()
    if teacher_top is None:
        return F.cross_entropy(logits, targets, reduction="sum")
    logp = F.log_softmax(logits, dim=-1)
    kl = topk_kl_terms(logp, teacher_top, indices).sum()
    return F.nll_loss(logp, targets, reduction="sum") + kl_weight * kl


def chunked_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: OutputHead,
    chunk_tokens: int,
    teacher: Teacher | None = None,
) -> torch.Tensor:
    """Summed next-token cross-entropy of `head` on `hidden` [B, T, H] for `labels` [B, T] (fp32), plus
    `teacher.weight` times the summed top-k KL from the teacher: equal to `ce_sum` (+ `topk_kl_sum`) of
    the full logits, without ever holding more than `chunk_tokens` rows of logits. Only the positions
    that carry loss are projected."""
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)}")
    mask = labels[:, 1:] != IGNORE_INDEX
    rows, targets = hidden[:, :-1][mask], labels[:, 1:][mask]
    if teacher is not None:
        teacher = Teacher(teacher.hidden[:, :-1][mask], teacher.head, teacher.top_k, teacher.weight)
    return rows_loss(rows, targets, head, chunk_tokens, teacher)


def rows_loss(
    rows: torch.Tensor,
    targets: torch.Tensor,
    head: OutputHead,
    chunk_tokens: int,
    teacher: Teacher | None = None,
) -> torch.Tensor:
    """`chunked_loss` on rows already aligned with their targets: `rows` [N, H] predict `targets` [N]
    (IGNORE_INDEX: no loss); `teacher.hidden` is then [N, H] too."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if rows.size(0) == 0:  # a zero that still reaches every parameter, as ce_sum's would
        return (rows.sum() + head.weight.sum()).float() * 0.0
    total = rows.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.size(0), chunk_tokens):
        end = start + chunk_tokens
        teacher_top = indices = None
        if teacher is not None:
            with torch.no_grad():  # [n, k] each: the teacher's chunk of logits is freed at once
                teacher_logits = teacher.head.logits(teacher.hidden[start:end])
                teacher_top, indices = teacher_top_k(teacher_logits, teacher.top_k)
        total = total + checkpoint(
            _chunk_loss,
            rows[start:end],
            head.weight,
            head.bias,
            head.softcap,
            targets[start:end],
            teacher_top,
            indices,
            teacher.weight if teacher is not None else 0.0,
            use_reentrant=False,
        )
    return total
