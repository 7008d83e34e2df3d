"""The early-exit trainer (seed 001 §3.1-3.2): exit layer + norm + head on the target's frozen first N layers.

Only the drafter's parts of the target are loaded (`models.early_exit.build_early_exit`): embeddings,
layers 0..N-1, the last layer(s), the final norm and the lm head. The frozen part runs without autograd
and is not handed to accelerate; only the `ExitHead` is prepared (DDP / FSDP / DeepSpeed wrap or shard
just the trainable parameters, each process keeps its own copy of the frozen layers).

Data: the distill stage's mix of every pair (target generations and open-source rows, seed 001 §3.2),
cross-entropy to the next token on the response (or on the whole row, `loss_on: all`), optionally plus
the KL to the full target's distribution (`loss: ce+kl`, which loads the whole target and shares its
first N layers with the drafter). Held out: loss and top-1 agreement with the full target's greedy
tokens, computed once per process by streaming the target layer by layer (`eval_reference.*.pt`).

The stage entry point is `pipelines.stages.early_exit`. Outputs in the work dir: `head/`
(`early_exit.safetensors`, `early_exit.json`), the per-step log `train_log.jsonl`; checkpoints
(`checkpoints/step-N/`) let a killed run resume with the same data order and RNG states, and are removed
once the head is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polydraft.models.decoder_layers import attention_masks, run_layers
from polydraft.models.early_exit import EarlyExitDrafter
from polydraft.models.partial_load import decoder_parts
from polydraft.train.chunked_loss import OutputHead, Teacher, chunked_loss, model_head
from polydraft.train.data import MixBatches
from polydraft.train.loop import HeldOut, LoopResult, LoopSettings, TrainJob, run_with_evals
from polydraft.train.losses import IGNORE_INDEX, ce_sum, loss_window, topk_kl_sum
from polydraft.train.runtime import loss_chunking
from polydraft.train.stage_metrics import HeadEval
from polydraft.train.step import StepStats, train_step

HEAD_DIR = "head"
LOG_FILE = "train_log.jsonl"


def eval_reference(
    work_dir: Path,
    target: tuple[str, str | None, bool],
    sequences: list[torch.Tensor],
    accelerator: Any,
    dtype: torch.dtype,
    attn: str,
) -> list[torch.Tensor]:
    """The full target's (path, revision, trust_remote_code) greedy tokens on this process's held-out
    batches, streamed once and cached."""
    from polydraft.models.target_stream import streamed_greedy_tokens

    if not sequences:
        return []
    path = work_dir / f"eval_reference.{accelerator.process_index}-of-{accelerator.num_processes}.pt"
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        if [c.shape for c in cached] == [s.shape for s in sequences]:
            return cached
    target_path, revision, trust_remote_code = target
    tokens = streamed_greedy_tokens(
        target_path, sequences, revision=revision, dtype=dtype, device=accelerator.device,
        attn_implementation=attn, trust_remote_code=trust_remote_code,
    )  # fmt: skip
    torch.save(tokens, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return tokens


def head_forward(
    drafter: EarlyExitDrafter,
    head: torch.nn.Module,
    input_ids: torch.Tensor,
    logits_to_keep: int = 0,
    project: bool = True,
) -> tuple[torch.Tensor, Any]:
    """Logits of the (prepared) exit head on the frozen part's layer-N states, at the last
    `logits_to_keep` positions (0: all), or with `project=False` the final-norm states the lm head
    would read; right padding needs no mask."""
    state = drafter.forward_shared(input_ids)
    hidden = state.hidden.to(next(head.parameters()).dtype)
    masks = drafter.exit_masks(state) if drafter.num_exit_layers else None
    logits, normed = head(
        hidden, state.position_embeddings, masks, None, state.position_ids, logits_to_keep, project
    )
    return (logits if project else normed), state


@torch.no_grad()
def teacher_logits(teacher: torch.nn.Module, drafter: EarlyExitDrafter, state: Any) -> torch.Tensor:
    """The full target's logits, continuing the shared layer-N states through its layers N..L-1."""
    return teacher_head(teacher).logits(teacher_hidden(teacher, drafter, state))


def teacher_head(teacher: torch.nn.Module) -> OutputHead:
    """The full target's lm head with its final soft-capping (Gemma 2), as the target's own forward."""
    return model_head(decoder_parts(teacher).lm_head, teacher.config)


@torch.no_grad()
def teacher_hidden(teacher: torch.nn.Module, drafter: EarlyExitDrafter, state: Any) -> torch.Tensor:
    """The full target's final-norm states (its lm head's input), continuing the shared layer-N states
    through its layers N..L-1."""
    parts = decoder_parts(teacher)
    n = drafter.num_shared_layers
    slots = list(range(n, drafter.num_hidden_layers))
    types = drafter.layer_types[n:]
    masks = attention_masks(teacher.config, state.hidden, None, None, state.position_ids, slots, types)
    hidden = run_layers(
        parts.layers[n:], state.hidden, state.position_embeddings, masks, None, state.position_ids, types
    )
    return parts.norm(hidden)


def exit_loss(
    drafter: EarlyExitDrafter,
    head: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    teacher: torch.nn.Module | None,
    kl_weight: float,
    kl_top_k: int,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of the exit head on a micro-batch, plus the weighted top-k KL to the full
    target (`ce+kl`); the head runs from the first position that carries loss (`loss_window`) on.
    `chunk_tokens`: compute it `train.chunked_loss`'s way, never holding more rows of logits."""
    first = loss_window(batch["labels"])
    labels = batch["labels"][:, first:]
    if chunk_tokens is not None:
        normed, state = head_forward(drafter, head, batch["input_ids"], labels.size(1), project=False)
        kl = None
        if teacher is not None:
            target_hidden = teacher_hidden(teacher, drafter, state)[:, first:]
            kl = Teacher(target_hidden, teacher_head(teacher), kl_top_k, kl_weight)
        # the exit head's logits are not soft-capped, in training as in decoding (decoding.eesd)
        return chunked_loss(normed, labels, model_head(drafter.exit.lm_head, None), chunk_tokens, kl)
    logits, state = head_forward(drafter, head, batch["input_ids"], labels.size(1))
    loss, _ = ce_sum(logits, labels)
    if teacher is not None:
        target = teacher_logits(teacher, drafter, state)[:, first:]
        loss = loss + kl_weight * topk_kl_sum(logits, target, labels, kl_top_k)
    return loss


@torch.no_grad()
def evaluate(
    accelerator: Any,
    drafter: EarlyExitDrafter,
    head: torch.nn.Module,
    evals: list[dict[str, torch.Tensor]],
    references: list[torch.Tensor],
) -> HeadEval:
    """Held-out loss and top-1 agreements of the head (with the full target's greedy tokens, with the
    data) and of the target itself (with the data)."""
    head.eval()
    device = accelerator.device
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    for batch, reference in zip(evals, references, strict=True):
        logits, _ = head_forward(drafter, head, batch["input_ids"].to(device))
        labels = batch["labels"].to(device)
        loss, count = ce_sum(logits, labels)
        predicted, next_labels = logits.argmax(-1)[:, :-1], labels[:, 1:]  # position t predicts t + 1
        reference = reference.to(device)[:, :-1]
        mask = next_labels != IGNORE_INDEX
        sums += torch.stack(
            [
                loss.double(),
                count.double(),
                ((predicted == reference) & mask).sum().double(),
                ((predicted == next_labels) & mask).sum().double(),
                ((reference == next_labels) & mask).sum().double(),
            ]
        )
    loss, count, agree, hits, target_hits = accelerator.reduce(sums, "sum").tolist()
    head.train()
    count = max(count, 1.0)
    return HeadEval(
        eval_loss=loss / count,
        top1_target=agree / count,
        top1_labels=hits / count,
        target_top1_labels=target_hits / count,
    )


def head_eval_log(metrics: HeadEval) -> dict[str, float]:
    return {f"eval/{k}": v for k, v in metrics.model_dump().items()}


@dataclass(frozen=True)
class ExitLoss:
    """Cross-entropy, and with the full target as `teacher` (`loss: ce+kl`) the weighted top-k KL to it."""

    teacher: torch.nn.Module | None
    kl_weight: float
    kl_top_k: int


def fit(
    accelerator: Any,
    drafter: EarlyExitDrafter,
    head: torch.nn.Module,
    optimization: tuple[Any, Any, float],
    batches: MixBatches,
    held_out: tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]],
    loop: LoopSettings,
    loss: ExitLoss,
    job: TrainJob,
) -> tuple[LoopResult, HeadEval | None, HeadEval | None]:
    """Train the head through the shared loop (`train.loop.run_with_evals`): steps with exact token-mean
    losses, evals. `optimization`: (optimizer, scheduler, max_grad_norm); `held_out`: the eval batches and
    the full target's greedy tokens on them (`eval_reference`). Returns the loop's result and the held-out
    metrics of the initial head and at the end."""
    optimizer, scheduler, max_grad_norm = optimization
    evals, references = held_out
    device = accelerator.device
    chunk_tokens = loss_chunking(accelerator, loop.loss_chunk_tokens)

    def one_step(step: int) -> StepStats:
        micro_batches = [{k: v.to(device) for k, v in b.items()} for b in batches.micro_batches(step)]
        return train_step(
            accelerator, head, optimizer, scheduler, micro_batches,
            lambda batch: exit_loss(drafter, head, batch, loss.teacher, loss.kl_weight, loss.kl_top_k, chunk_tokens),
            max_grad_norm,
        )  # fmt: skip

    heldout = None
    if evals:  # the head as initialised from the target's last layer is the baseline training must beat
        heldout = HeldOut(
            lambda: evaluate(accelerator, drafter, head, evals, references), head_eval_log, HeadEval
        )
    # the frozen layers run without autograd (forward only), the head forward and backward
    frozen = sum(p.numel() for p in drafter.parameters()) - sum(p.numel() for p in head.parameters())
    trained = sum(p.numel() for p in head.parameters())
    flops = 2.0 * frozen + 6.0 * trained
    return run_with_evals(accelerator, loop, job, scheduler, one_step, heldout, flops, batches.epoch)
