"""The calibration trainer (seed 001 §3.3, eq. 5, App. B): predict whether each draft token is accepted.

Labels, as the seed builds them: positions are sampled in the distill mix (inside the responses, where
drafting happens); from each, the drafter drafts `draft_length` tokens greedily; one target forward over
prefix + drafts gives the target's greedy token at every draft position; chi_i = 1 while drafts and
target agree, 0 from the first disagreement on. Features per draft step i: the target's last hidden state
that produced the prefix's newest token, and the drafter's last hidden state that produced draft i (see
`models.calibration`). Extra positions from the mix's `eval` split are the held-out set of the report.

Drafters: the early-exit head (attached to the loaded target, sharing its first N layers) and, with
`calibrate.drafters: all`, every finetuned drafter (`finetune/<pair>/`) on its own pair's rows.

The stage entry point is `pipelines.stages.calibrate`. Outputs per drafter, `<work_dir>/<name>/`:
`calibration.safetensors`, `calibration.json`, `report.json` (written last: a drafter with a report is
done and skipped by a rerun). Label chunks (`labels/`) and checkpoints make a killed run resume; both
are removed when the drafter is done.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from polydraft.models.calibration import acceptance_labels
from polydraft.models.decoder_layers import cache_kwargs
from polydraft.train.data import epoch_order, micro_batch_indices
from polydraft.train.loop import LoopSettings, TrainingLoop, TrainJob
from polydraft.train.losses import IGNORE_INDEX, scale_for_step
from polydraft.train.runtime import prepare_for_training
from polydraft.train.step import OptimSettings, StepLog, StepStats

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"
CHUNK = 50
"""Positions per label chunk file (the unit of resumable label building)."""

Forward = Callable[[torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]
"""(input_ids (1, T), cache or None) -> (logits (1, T, V), last hidden states (1, T, d))."""


# ============================================================================ labels


def hf_forward(model: torch.nn.Module) -> Forward:
    """A causal LM as (logits, last hidden state): the decoder's output (after its final norm) is the
    input of the lm head."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def forward(input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = decoder(
            input_ids=input_ids, use_cache=cache is not None, **cache_kwargs(decoder, cache)
        ).last_hidden_state
        return head(hidden), hidden

    return forward


@torch.no_grad()
def label_position(
    target: Forward, drafter: Forward, new_cache: Callable[[], Any], prefix: list[int], k: int, device: Any
) -> dict[str, torch.Tensor]:
    """Draft `k` tokens greedily after `prefix`, verify them with one target forward, label them.

    Returns `target_hidden` (d_T,): the target's state at position len(prefix)-2, which produced the
    prefix's newest token; `draft_hidden` (k, d_D): the drafter's state that produced each draft;
    `drafts`, `target_tokens` and `labels` (chi) of the k steps.
    """
    if len(prefix) < 2:
        raise ValueError("a prefix needs at least 2 tokens (the newest one and the state that produced it)")
    cache = new_cache()
    logits, hidden = drafter(torch.tensor([prefix], device=device), cache)
    drafts, states = [], []
    for _ in range(k):
        token = int(logits[0, -1].argmax())
        drafts.append(token)
        states.append(hidden[0, -1])
        logits, hidden = drafter(torch.tensor([[token]], device=device), cache)
    target_logits, target_hidden = target(torch.tensor([prefix + drafts], device=device), None)
    n = len(prefix)
    target_tokens = target_logits[0, n - 1 : n - 1 + k].argmax(-1).tolist()
    return {
        "target_hidden": target_hidden[0, n - 2].cpu(),
        "draft_hidden": torch.stack(states).cpu(),
        "drafts": torch.tensor(drafts),
        "target_tokens": torch.tensor(target_tokens),
        "labels": torch.tensor(acceptance_labels(drafts, target_tokens)),
    }


def sample_positions(examples: list[dict[str, list[int]]], count: int, seed: int) -> list[list[int]]:
    """`count` prefixes drawn from the examples: a random row, cut at a random point inside its response
    (from the end of the prompt to the token before the last), at least 2 tokens long."""
    rng = random.Random(seed)
    spans = []
    for example in examples:
        start = next((i for i, label in enumerate(example["labels"]) if label != IGNORE_INDEX), None)
        if start is not None and max(start, 2) <= len(example["input_ids"]) - 1:
            spans.append((example["input_ids"], max(start, 2)))
    if not spans:
        raise ValueError("no mix row has a response to sample positions from")
    out = []
    for _ in range(count):
        ids, first = spans[rng.randrange(len(spans))]
        out.append(ids[: rng.randint(first, len(ids) - 1)])
    return out


def build_labels(
    folder: Path, split: str, prefixes: list[list[int]], label: Callable[[list[int]], dict], accelerator: Any
) -> dict[str, torch.Tensor]:
    """Label every prefix, in chunk files that a rerun reuses; processes share the chunks round-robin."""
    folder.mkdir(parents=True, exist_ok=True)
    chunks = [prefixes[i : i + CHUNK] for i in range(0, len(prefixes), CHUNK)]
    for index in range(accelerator.process_index, len(chunks), accelerator.num_processes):
        path = folder / f"{split}-{index:05d}.pt"
        if not path.is_file():
            rows = [label(prefix) for prefix in chunks[index]]
            merged = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
            torch.save(merged, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
    accelerator.wait_for_everyone()
    parts = [torch.load(folder / f"{split}-{i:05d}.pt", weights_only=True) for i in range(len(chunks))]
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def flatten(labels: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Positions x steps -> one row per draft step: `steps` (1-based), `position` (row of target_hidden)."""
    positions, k = labels["labels"].shape
    return {
        "steps": torch.arange(1, k + 1).repeat(positions),
        "position": torch.arange(positions).repeat_interleave(k),
        "draft_hidden": labels["draft_hidden"].reshape(positions * k, -1),
        "labels": labels["labels"].reshape(-1),
        "target_hidden": labels["target_hidden"],
    }


# ============================================================================ training


@torch.no_grad()
def predict(
    model: torch.nn.Module, rows: dict[str, torch.Tensor], device: Any, batch: int = 1024
) -> torch.Tensor:
    """P(accepted) for every row."""
    out = []
    for i in range(0, len(rows["labels"]), batch):
        steps = rows["steps"][i : i + batch].to(device)
        target = rows["target_hidden"][rows["position"][i : i + batch]].to(device).float()
        draft = rows["draft_hidden"][i : i + batch].to(device).float()
        out.append(model(steps, target, draft).float().softmax(-1)[:, 1].cpu())
    return torch.cat(out)


def total_steps(rows: int, per_device: int, accelerator: Any, epochs: float, max_steps: int | None) -> int:
    """`max_steps`, else `epochs` passes over `rows` labelled steps in global batches. ValueError when the
    rows do not fill one global batch."""
    global_batch = per_device * accelerator.num_processes * accelerator.gradient_accumulation_steps
    steps_per_epoch = rows // global_batch
    if steps_per_epoch == 0:
        raise ValueError(
            f"{rows} labelled steps are fewer than one global batch of {global_batch}; "
            "raise calibrate.num_positions or lower calibrate.loop.per_device_batch_size"
        )
    return max_steps or max(1, int(epochs * steps_per_epoch))


def fit(
    accelerator: Any,
    model: torch.nn.Module,
    rows: dict[str, torch.Tensor],
    optim: OptimSettings,
    loop: LoopSettings,
    seed: int,
    job: TrainJob,
) -> torch.nn.Module:
    """2-class cross-entropy on the labelled steps for `loop.total_steps` steps (`total_steps`), in an
    order drawn per epoch from `seed`; resumes from `job.checkpoints`."""
    device = accelerator.device
    world, rank, accum = (
        accelerator.num_processes,
        accelerator.process_index,
        accelerator.gradient_accumulation_steps,
    )
    per_device = loop.per_device_batch_size
    global_batch = per_device * world * accum
    steps_per_epoch = len(rows["labels"]) // global_batch
    model, optimizer, scheduler = prepare_for_training(
        model, optim, loop.total_steps, per_device, accelerator
    )
    job.checkpoints.parent.mkdir(parents=True, exist_ok=True)
    training = TrainingLoop(
        accelerator, loop.plan, label=job.label, checkpoints=job.checkpoints, log_path=job.log_path,
        scheduler=scheduler, quiet=job.quiet,
    )  # fmt: skip
    training.resume()
    steplog = StepLog(
        job.tracker, job.log_path, prefix=job.prefix, log_every=loop.log_every, flops_per_token=0.0,
        peak_flops=None, world=world, main_process=accelerator.is_main_process,
    )  # fmt: skip
    order: dict[int, list[int]] = {}  # the example order of the current epoch

    def one_step(step: int) -> StepStats:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        if epoch not in order:
            order.clear()
            order[epoch] = epoch_order(len(rows["labels"]), seed, epoch)
        scale = scale_for_step(global_batch, world, accum)
        loss_sum = torch.zeros((), device=device)
        grad_norm = None
        for micro in range(accum):
            index = torch.tensor(
                micro_batch_indices(order[epoch], in_epoch, micro, rank, world, per_device, accum)
            )
            with accelerator.accumulate(model):
                logits = model(
                    rows["steps"][index].to(device),
                    rows["target_hidden"][rows["position"][index]].to(device).float(),
                    rows["draft_hidden"][index].to(device).float(),
                )
                loss = F.cross_entropy(logits.float(), rows["labels"][index].to(device), reduction="sum")
                accelerator.backward(loss * scale)
                if accelerator.sync_gradients and optim.max_grad_norm:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), optim.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        return StepStats(
            loss=accelerator.reduce(loss_sum, "sum").item() / global_batch,
            lr=lr,
            grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
            loss_tokens=global_batch,
            input_tokens=global_batch,
        )

    training.run(one_step, steplog, epoch=lambda step: step / steps_per_epoch, throughput_unit="rows")
    return model
