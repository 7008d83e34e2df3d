"""The heads trainer: Medusa-1 or BPD proposal heads on the frozen target's last hidden states.

The whole target is loaded (bf16 on a GPU) and frozen; only its decoder runs, without autograd, to give
the final hidden states h_t; only the heads are handed to accelerate (DDP / FSDP / DeepSpeed wrap just
them; every process keeps its own frozen target). Proposal head i at position t learns token t+2+i
(`models.heads`), with cross-entropy on the response tokens of the distill stage's mix, every pair
together. The loss is Medusa-1's weighted sum over heads, sum_i decay^i * CE_i, each CE_i the exact
token mean over the optimizer step's global batch: the shared step (`train.step.train_step`) scales a
micro-batch's loss sum by 1 / (the step's loss tokens), so each head's sum is weighted by
decay^i * (step loss tokens) / (head i's step tokens) before it.

Held out, per head: loss, top-1 accuracy against the data (`top1`) and top-1 agreement with the target's
own greedy token at that position given the true prefix (`top1_target`: the argmax of the target's head
on h_{t+1+i}, which the same forward already gives), the quantity that decides acceptance at
temperature 0.

The stage entry point is `pipelines.stages.heads`. Outputs in the work dir: `heads/`
(`models.heads.save_heads`), the per-step log `train_log.jsonl`; checkpoints (`checkpoints/step-N/`)
let a killed run resume with the same data order, RNG and optimizer states, and are removed once the
heads are written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from polydraft.models.heads import Heads
from polydraft.train.chunked_loss import model_head, rows_loss
from polydraft.train.data import MixBatches
from polydraft.train.loop import HeldOut, LoopResult, LoopSettings, TrainJob, run_with_evals
from polydraft.train.losses import IGNORE_INDEX
from polydraft.train.runtime import loss_chunking, unwrap
from polydraft.train.stage_metrics import HeadScore, HeadsEval
from polydraft.train.step import StepStats, token_counts, train_step

HEADS_DIR = "heads"
LOG_FILE = "train_log.jsonl"


# ----------------------------------------------------------------------------- the heads' loss


def head_labels(labels: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[num_heads, B, T]: entry (i, b, t) is the label head i learns at position t, labels[b, t+2+i]."""
    out = torch.full((num_heads, *labels.shape), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    for i in range(num_heads):
        out[i, :, : -(2 + i)] = labels[:, 2 + i :]
    return out


def label_counts(labels: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Tokens carrying loss for each head, [num_heads] (float64 for exact reductions)."""
    return (head_labels(labels, num_heads) != IGNORE_INDEX).flatten(1).sum(1).double()


@torch.no_grad()
def last_hidden(target: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The frozen target's final hidden states [B, T, H] (the input of its lm head), no autograd, on the
    batch's device (a target spread over GPUs ends on its last one)."""
    ids = batch["input_ids"]
    return target.base_model(input_ids=ids, attention_mask=batch["attention_mask"]).last_hidden_state.to(
        ids.device
    )


def heads_forward(
    heads: torch.nn.Module, shared_head: torch.nn.Module | None, hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [num_heads, N, V], labels [num_heads, N]) on the N positions where some head has a label.

    The heads run on those rows only: the prompt's positions and the padding never reach the lm heads.
    """
    rows = (labels != IGNORE_INDEX).any(0)
    selected = hidden[rows].to(next(heads.parameters()).dtype)
    logits = heads(selected, shared_head)  # `bpd`: the target's lm head, maybe on another GPU
    return logits.to(labels.device), labels[:, rows]


def chunked_ce_sums(
    heads: torch.nn.Module,
    bare: Heads,
    shared_head: torch.nn.Module | None,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """`ce_sums` of `heads_forward`'s logits, computed `train.chunked_loss`'s way: `heads` (maybe
    wrapped by DDP) runs the residual blocks, each head's lm head (from `bare`, the unwrapped heads)
    projects `chunk_tokens` rows at a time."""
    rows = (labels != IGNORE_INDEX).any(0)
    selected = hidden[rows].to(next(heads.parameters()).dtype)
    blocks = heads(selected, shared_head, project=False)
    sums = []
    for i in range(labels.shape[0]):  # Medusa heads and BPD's frozen head carry no soft-capping
        head = model_head(bare.lm_head_of(i, shared_head), None)
        sums.append(rows_loss(blocks[i], labels[i, rows], head, chunk_tokens))
    return torch.stack(sums)


def ce_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy per head [num_heads] (fp32)."""
    return torch.stack(
        [
            F.cross_entropy(logits[i].float(), labels[i], ignore_index=IGNORE_INDEX, reduction="sum")
            for i in range(labels.shape[0])
        ]
    )


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    accelerator: Any,
    target: torch.nn.Module,
    heads: torch.nn.Module,
    shared_head: torch.nn.Module | None,
    evals: list[dict[str, torch.Tensor]],
    num_heads: int,
) -> HeadsEval:
    """Held-out loss, top-1 vs the data and top-1 vs the target's greedy token, per head; and the target's
    own next-token top-1 vs the data (`target_top1`), for scale."""
    heads.eval()
    device = accelerator.device
    target_head = target.get_output_embeddings()
    # per head: loss sum, count, hits vs labels, hits vs target; then the target's hits and count
    sums = torch.zeros(4 * num_heads + 2, dtype=torch.float64, device=device)
    for batch in evals:
        batch = {k: v.to(device) for k, v in batch.items()}
        hidden = last_hidden(target, batch)
        greedy = target_head(hidden).argmax(-1).to(device)  # the target's greedy token for position t + 1
        labels = head_labels(batch["labels"], num_heads)
        reference = head_labels(torch.cat([greedy[:, :1], greedy[:, :-1]], 1), num_heads)
        rows = (labels != IGNORE_INDEX).any(0)
        logits, selected = heads_forward(heads, shared_head, hidden, labels)
        predicted = logits.argmax(-1)
        mask = selected != IGNORE_INDEX
        reference = reference[:, rows]
        per_head = torch.stack(
            [
                ce_sums(logits, selected).double(),
                mask.sum(1).double(),
                ((predicted == selected) & mask).sum(1).double(),
                ((predicted == reference) & mask).sum(1).double(),
            ]
        )
        next_labels = batch["labels"][:, 1:]
        next_mask = next_labels != IGNORE_INDEX
        target_hits = ((greedy[:, :-1] == next_labels) & next_mask).sum().double()
        sums += torch.cat([per_head.flatten(), torch.stack([target_hits, next_mask.sum().double()])])
    totals = accelerator.reduce(sums, "sum").view(-1).tolist()
    heads.train()
    scores = []
    for i in range(num_heads):
        loss, count, hits, agree = (totals[k * num_heads + i] for k in range(4))
        count = max(count, 1.0)
        scores.append(HeadScore(loss=loss / count, top1=hits / count, top1_target=agree / count))
    return HeadsEval(
        eval_loss=sum(score.loss for score in scores) / num_heads,
        heads=scores,
        target_top1=totals[-2] / max(totals[-1], 1.0),
    )


def eval_log(metrics: HeadsEval) -> dict[str, float]:
    out = {"eval/loss": metrics.eval_loss, "eval/target_top1": metrics.target_top1}
    for i, score in enumerate(metrics.heads):
        out |= {f"eval/head{i}_{k}": v for k, v in score.model_dump().items()}
    return out


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class HeadsSettings:
    """The heads' loss: `num_heads` heads, head i's token mean weighted `loss_decay ** i`; BPD heads project
    through the target's own lm head (`shared_head`), Medusa heads through their own (None)."""

    num_heads: int
    loss_decay: float
    shared_head: torch.nn.Module | None


def fit(
    accelerator: Any,
    target: torch.nn.Module,
    heads: torch.nn.Module,
    optimization: tuple[Any, Any, float],
    batches: MixBatches,
    evals: list[dict[str, torch.Tensor]],
    loop: LoopSettings,
    settings: HeadsSettings,
    job: TrainJob,
) -> tuple[LoopResult, HeadsEval | None, HeadsEval | None]:
    """Train the heads through the shared loop (`train.loop.run_with_evals`): steps with exact per-head
    token means, per-head losses, evals. `optimization`: (optimizer, scheduler, max_grad_norm). Returns the
    loop's result and the held-out metrics of the initial heads and at the end."""
    optimizer, scheduler, max_grad_norm = optimization
    num_heads, shared_head = settings.num_heads, settings.shared_head
    device, main_process = accelerator.device, accelerator.is_main_process
    weights = torch.tensor(
        [settings.loss_decay**i for i in range(num_heads)], dtype=torch.float64, device=device
    )
    chunk_tokens = loss_chunking(accelerator, loop.loss_chunk_tokens)
    bare = unwrap(accelerator, heads)
    current: dict[str, torch.Tensor] = {}  # this step's per-head loss factors and detached loss sums

    def loss_sum(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden, labels = last_hidden(target, batch), head_labels(batch["labels"], num_heads)
        if chunk_tokens is None:
            sums = ce_sums(*heads_forward(heads, shared_head, hidden, labels))
        else:
            sums = chunked_ce_sums(heads, bare, shared_head, hidden, labels, chunk_tokens)
        current["sums"] = current["sums"] + sums.detach().double()
        return (sums * current["factors"].to(sums.dtype)).sum()

    def one_step(step: int) -> StepStats:
        micro_batches = [{k: v.to(device) for k, v in b.items()} for b in batches.micro_batches(step)]
        step_tokens, _ = token_counts(micro_batches, accelerator)
        local = sum(label_counts(b["labels"], num_heads) for b in micro_batches)
        head_tokens = accelerator.reduce(local, "sum")
        # train_step divides every loss sum by `step_tokens`; this makes head i's a decay^i-weighted
        # share of its own token mean (a head with no token in the step gets no loss)
        current["factors"] = torch.where(
            head_tokens > 0, weights * step_tokens / head_tokens.clamp(min=1), 0.0
        )
        current["sums"] = torch.zeros(num_heads, dtype=torch.float64, device=device)
        stats = train_step(accelerator, heads, optimizer, scheduler, micro_batches, loss_sum, max_grad_norm)
        done = step + 1
        if done % loop.log_every == 0 or done == loop.total_steps:  # every process joins the reduction
            losses = (accelerator.reduce(current["sums"], "sum") / head_tokens.clamp(min=1)).tolist()
            if main_process:
                metrics = {f"train/head{i}_loss": loss for i, loss in enumerate(losses)}
                job.tracker.log(metrics, step=done, echo=False)
        return stats

    held_out = None
    if evals:
        held_out = HeldOut(
            lambda: evaluate(accelerator, target, heads, shared_head, evals, num_heads), eval_log, HeadsEval
        )
    # the target runs forward only (2 FLOPs a parameter and token), the heads forward and backward
    frozen = sum(p.numel() for p in target.parameters())
    trained = sum(p.numel() for p in heads.parameters())
    flops = 2.0 * frozen + 6.0 * trained
    return run_with_evals(accelerator, loop, job, scheduler, one_step, held_out, flops, batches.epoch)
