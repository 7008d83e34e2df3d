"""Token-level losses as sums, so that a trainer can normalise by the tokens of the whole optimizer step.

Averaging a per-micro-batch mean over micro-batches and ranks weights tokens unequally when batches hold
different numbers of loss tokens (padding, prompt masking). Summing here and dividing by the global
token count of the step (`scale_for_step`) gives the exact mean over the step's tokens, identical for
one rank or many and for any gradient-accumulation split.

Labels follow the Hugging Face convention: `labels[t]` is the token at position t, positions that carry
no loss hold -100, and the logits at t predict the label at t + 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at positions 0..T-2 and the labels they predict (positions 1..T-1)."""
    return logits[:, :-1, :], labels[:, 1:]


def loss_window(labels: torch.Tensor) -> int:
    """The first position whose logits predict a loss-carrying label (position t predicts label t + 1).

    A batch with loss on the responses only needs the output head and the cross-entropy, which cost more
    than a whole 1-layer decoder when the vocabulary is 16x the width, only from there on. A batch without
    a loss-carrying label keeps the last position (its loss is 0 either way).
    """
    carried = (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero()
    return int(carried[0, 0]) if len(carried) else labels.size(1) - 1


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy (in fp32) and the number of tokens that carry loss."""
    logits, labels = shift(logits, labels)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, (labels != IGNORE_INDEX).sum()


def topk_kl_sum(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Summed forward KL(teacher || student) over loss-carrying positions, on the teacher's top-k tokens
    plus one bucket holding every other token.

    Keeping k tokens instead of the whole vocabulary saves memory and bandwidth; the bucket keeps it a
    true KL of the two (k+1)-way distributions: zero exactly when the student puts the teacher's mass
    on each of the k tokens, and it still penalises student mass spread over the rest.
    """
    student, labels = shift(student_logits, labels)
    teacher = teacher_logits[:, :-1, :]
    mask = labels != IGNORE_INDEX
    student_logp = F.log_softmax(student[mask].float(), dim=-1)
    teacher_top, indices = teacher_top_k(teacher[mask], top_k)
    return topk_kl_terms(student_logp, teacher_top, indices).sum()


def teacher_top_k(teacher_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's k largest log-probabilities (fp32) over the last dimension, and their token ids."""
    teacher_logp = F.log_softmax(teacher_logits.float(), dim=-1)
    return teacher_logp.topk(min(top_k, teacher_logp.size(-1)), dim=-1)


def topk_kl_terms(
    student_logp: torch.Tensor, teacher_top: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Per-position KL of `topk_kl_sum` from the student's log-probabilities [N, V] and the teacher's
    top-k ones with their ids ([N, k] each, `teacher_top_k`)."""
    student_top = student_logp.gather(-1, indices)
    tiny = torch.finfo(torch.float32).tiny
    teacher_rest = (1.0 - teacher_top.exp().sum(-1)).clamp_min(0.0)
    student_rest = (1.0 - student_top.exp().sum(-1)).clamp_min(tiny)
    top_terms = (teacher_top.exp() * (teacher_top - student_top)).sum(-1)
    rest_terms = torch.xlogy(teacher_rest, teacher_rest) - teacher_rest * student_rest.log()
    return top_terms + rest_terms


def top1_matches(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many loss-carrying positions the model's argmax predicts exactly, and how many there are.

    On rows the target generated greedily (temperature 0), the labels are the target's own top-1
    tokens, so this is the drafter's top-1 agreement with the target: a cheap proxy for acceptance.
    """
    logits, labels = shift(logits, labels)
    mask = labels != IGNORE_INDEX
    return (logits.argmax(-1).eq(labels) & mask).sum(), mask.sum()


def scale_for_step(global_tokens: int, num_processes: int, grad_accum_steps: int) -> float:
    """Factor turning a micro-batch loss *sum* into its share of the step's token mean.

    DDP/FSDP/DeepSpeed average gradients over processes and accelerate (or DeepSpeed) divides each
    micro-batch loss by the accumulation steps; multiplying by both undoes that, and dividing by the
    step's global token count makes the accumulated gradient that of the mean over all its tokens.
    """
    return num_processes * grad_accum_steps / max(1, global_tokens)
