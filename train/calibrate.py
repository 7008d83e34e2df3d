"""The calibration trainer (seed 001 §3.3, eq. 5, App. B): predict whether each draft token is accepted.

Labels, as the seed builds them: positions are sampled in the distill mix (inside the responses, where
drafting happens); from each, the drafter drafts `draft_length` tokens greedily; one target forward over
prefix + drafts gives the target's greedy token at every draft position; chi_i = 1 while drafts and
target agree, 0 from the first disagreement on. Features per draft step i: the target's last hidden state
that produced the prefix's newest token, and the drafter's last hidden state that produced draft i (see
`models.calibration`). Extra positions from the mix's `eval` split are the held-out set of the report.

Drafters: the early-exit head (attached to the loaded target, sharing its first N layers) and, with
`calibrate.drafters: all`, every finetuned drafter (`finetune/<pair>/`) on its own pair's rows.

Runner side: `run`, which launches one process (the whole target is spread over the visible GPUs).
Subprocess side: `main`. Outputs per drafter, `<work_dir>/<name>/`:
`calibration.safetensors`, `calibration.json`, `report.json` (written last: a drafter with a report is
done and skipped by a rerun). Label chunks (`labels/`) and checkpoints make a killed run resume; both
are removed when the drafter is done.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from models.calibration import CalibrationModel, acceptance_labels, calibration_metrics
from pipelines.schema import CalibrateConfig, Recipe
from pipelines.stage import (
    StageContext,
    StageFailed,
    StageResult,
    StageSpec,
    launch_training,
    run_training_process,
    setup_process_logging,
    tracker_for_spec,
)
from train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from train.data import encode_rows, epoch_order, micro_batch_indices
from train.losses import IGNORE_INDEX, scale_for_step
from train.runtime import check_finite, configure_deepspeed, make_accelerator, resolve_mixed_precision
from train.schedule import build_optimizer, build_scheduler
from train.steplog import append_log, truncate_log

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"
SINGLE_PROCESS = "recipes/accelerate/single.yaml"
CHUNK = 50
"""Positions per label chunk file (the unit of resumable label building)."""

Forward = Callable[[torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]
"""(input_ids (1, T), cache or None) -> (logits (1, T, V), last hidden states (1, T, d))."""

# ============================================================================ runner side


def run(recipe: Recipe, ctx: StageContext) -> StageResult:
    """Stage `calibrate`: launch the training subprocess, return the held-out metrics per drafter."""
    for needed in ("distill", "early_exit"):
        if needed not in ctx.upstream:
            raise StageFailed(f"calibrate needs the {needed} stage's output: enable the {needed} stage")
    if recipe.calibrate.drafters == "all" and "finetune" not in ctx.upstream:
        raise StageFailed("calibrate.drafters: all needs the finetune stage; enable it or use `early_exit`")
    # one process: labelling needs the whole target, which load_target spreads over every visible GPU
    # (a 70B target fits no single one); the calibration model itself is small
    single = recipe.launch.model_copy(update={"accelerate_config": SINGLE_PROCESS, "num_processes": None})
    return StageResult(
        metrics=launch_training(recipe.model_copy(update={"launch": single}), ctx, "train.calibrate")
    )


# ============================================================================ labels


def hf_forward(model: torch.nn.Module) -> Forward:
    """A causal LM as (logits, last hidden state): the decoder's output (after its final norm) is the
    input of the lm head."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def forward(input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = decoder(
            input_ids=input_ids, past_key_values=cache, use_cache=cache is not None
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
        raise StageFailed("calibrate: no mix row has a response to sample positions from")
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


def fit(
    accelerator: Any,
    model: torch.nn.Module,
    rows: dict[str, torch.Tensor],
    block: CalibrateConfig,
    folder: Path,
    tracker: Any,
    name: str,
) -> torch.nn.Module:
    """2-class cross-entropy on the labelled steps; resumes from `folder/checkpoints`."""
    loop, optim, device = block.loop, block.optim, accelerator.device
    world, rank, accum = (
        accelerator.num_processes,
        accelerator.process_index,
        accelerator.gradient_accumulation_steps,
    )
    per_device = loop.per_device_batch_size
    global_batch = per_device * world * accum
    steps_per_epoch = len(rows["labels"]) // global_batch
    if steps_per_epoch == 0:
        raise StageFailed(
            f"calibrate {name}: {len(rows['labels'])} labelled steps are fewer than one global batch of "
            f"{global_batch}; raise calibrate.num_positions or lower loop.per_device_batch_size"
        )
    total_steps = loop.max_steps or max(1, int(loop.epochs * steps_per_epoch))
    optimizer = build_optimizer(model, optim.lr, optim.weight_decay, tuple(optim.betas), optim.eps)
    scheduler = build_scheduler(
        optimizer, total_steps, optim.warmup_ratio, optim.schedule, optim.min_lr_ratio
    )
    configure_deepspeed(accelerator, per_device, optim.max_grad_norm)
    model, optimizer = accelerator.prepare(model, optimizer)
    folder.mkdir(parents=True, exist_ok=True)
    checkpoints, log_path = folder / "checkpoints", folder / "train_log.jsonl"
    step, last_checkpoint = 0, latest_checkpoint(checkpoints)
    if last_checkpoint is not None:
        step = load_checkpoint(accelerator, last_checkpoint, {"scheduler": scheduler})["step"]
    if accelerator.is_main_process:
        truncate_log(log_path, step)
    order, order_epoch = [], -1
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = epoch_order(len(rows["labels"]), loop.seed, epoch), epoch
        scale = scale_for_step(global_batch, world, accum)
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            index = torch.tensor(micro_batch_indices(order, in_epoch, micro, rank, world, per_device, accum))
            with accelerator.accumulate(model):
                logits = model(
                    rows["steps"][index].to(device),
                    rows["target_hidden"][rows["position"][index]].to(device).float(),
                    rows["draft_hidden"][index].to(device).float(),
                )
                loss = F.cross_entropy(logits.float(), rows["labels"][index].to(device), reduction="sum")
                accelerator.backward(loss * scale)
                if accelerator.sync_gradients and optim.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), optim.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        step_loss = accelerator.reduce(loss_sum, "sum").item() / global_batch
        check_finite(step_loss, step + 1, str(last_checkpoint) if last_checkpoint else None)
        scheduler.step()
        step += 1
        if accelerator.is_main_process:
            append_log(log_path, {"step": step, "loss": step_loss})
            if step % loop.log_every == 0 or step == total_steps:
                tracker.log({f"{name}/train/loss": step_loss}, step=step)
        if step % loop.checkpoint_every == 0 or step == total_steps:
            last_checkpoint = save_checkpoint(
                accelerator, checkpoints, step, {}, loop.keep_checkpoints, {"scheduler": scheduler}
            )
    return model


# ============================================================================ subprocess side


def main(argv: list[str] | None = None) -> None:
    """`python -m train.calibrate SPEC.json`, started by `accelerate launch` on every process."""
    spec = StageSpec.read((argv or sys.argv[1:])[0])
    setup_process_logging(spec)
    recipe = spec.parsed_recipe
    loop = recipe.calibrate.loop
    cuda = torch.cuda.is_available() and not recipe.launch.cpu
    accelerator = make_accelerator(loop.grad_accum_steps, resolve_mixed_precision(loop.mixed_precision, cuda))
    tracker = tracker_for_spec(spec, accelerator.is_main_process)
    run_training_process(spec, accelerator, tracker, lambda: calibrate(spec, accelerator, tracker))


def load_target(target: Any, accelerator: Any) -> torch.nn.Module:
    """The whole target: spread over the visible GPUs by accelerate (a 70B target fits no single one) when
    this is the only process, else on this process's device."""
    from transformers import AutoModelForCausalLM

    from models.loading import load_causal_lm, resolve_dtype

    device = accelerator.device
    if device.type == "cuda" and accelerator.num_processes == 1:
        return AutoModelForCausalLM.from_pretrained(
            target.path, revision=target.revision, dtype=resolve_dtype(target.dtype, device),
            trust_remote_code=target.trust_remote_code, device_map="auto",
        ).eval()  # fmt: skip
    return load_causal_lm(target.path, target.revision, target.dtype, target.trust_remote_code, device)


def drafters_of(
    spec: StageSpec, target: torch.nn.Module, block: CalibrateConfig
) -> list[tuple[str, Any, list[str] | None]]:
    """(name, loader, pairs) per drafter; the loader returns (forward, new_cache, hidden size, source).

    `pairs` None: every pair of the mix (the early-exit head serves them all).
    """
    from models.early_exit import attach_exit_head

    def early_exit() -> tuple[Forward, Callable[[], Any], int, str]:
        head = Path(spec.upstream["early_exit"]) / "head"
        drafter = attach_exit_head(target, head)
        return (
            (lambda ids, cache: drafter(ids, cache=cache)),
            drafter.new_cache,
            target.config.hidden_size,
            str(head),
        )

    out: list[tuple[str, Any, list[str] | None]] = [("early_exit", early_exit, None)]
    if block.drafters == "all":
        finetune = Path(spec.upstream["finetune"])
        for folder in sorted(p for p in finetune.iterdir() if (p / "config.json").is_file()):
            out.append((folder.name, lambda folder=folder: standalone(folder, target), [folder.name]))
    return out


def standalone(folder: Path, target: torch.nn.Module) -> tuple[Forward, Callable[[], Any], int, str]:
    """A finetuned drafter (Hugging Face folder) on the target's device, checked to share its vocabulary."""
    from transformers import AutoModelForCausalLM, DynamicCache

    reference = next(target.parameters())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=reference.dtype).to(reference.device).eval()
    ours, theirs = model.config.get_text_config().vocab_size, target.config.get_text_config().vocab_size
    if ours != theirs:
        raise StageFailed(
            f"calibrate: drafter {folder} has {ours} tokens, the target {theirs}; they must match"
        )
    return hf_forward(model), DynamicCache, model.config.get_text_config().hidden_size, str(folder)


def calibrate(spec: StageSpec, accelerator: Any, tracker: Any) -> dict[str, Any]:
    """Label, train and report one calibration model per drafter; returns the held-out metrics."""
    from models.loading import load_tokenizer

    target_spec, work_dir = spec.resolved_target, Path(spec.work_dir)
    block = spec.parsed_recipe.calibrate
    tokenizer = load_tokenizer(target_spec.path, target_spec.revision, target_spec.trust_remote_code)
    target = load_target(target_spec, accelerator)
    metrics: dict[str, Any] = {}
    for name, load, pairs in drafters_of(spec, target, block):
        folder = work_dir / name
        if not (folder / REPORT_FILE).is_file():  # else done by an earlier, interrupted run
            report = calibrate_drafter(
                accelerator,
                tracker,
                block,
                Path(spec.upstream["distill"]),
                tokenizer,
                target,
                name,
                load,
                pairs,
                folder,
            )
            if accelerator.is_main_process:
                (folder / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
                shutil.rmtree(folder / "checkpoints", ignore_errors=True)
                shutil.rmtree(folder / "labels", ignore_errors=True)
            accelerator.wait_for_everyone()
            accelerator.free_memory()
        report = json.loads((folder / REPORT_FILE).read_text(encoding="utf-8"))
        metrics.update({f"{name}/{k}": v for k, v in report["heldout"].items()})
    return metrics


def calibrate_drafter(
    accelerator: Any,
    tracker: Any,
    block: CalibrateConfig,
    distill_dir: Path,
    tokenizer: Any,
    target: torch.nn.Module,
    name: str,
    load: Callable[[], tuple[Forward, Callable[[], Any], int, str]],
    pairs: list[str] | None,
    folder: Path,
) -> dict[str, Any]:
    """Labels (train and held-out), the trained model saved in `folder`, and the report."""
    from accelerate.utils import set_seed

    from distill.mix import mix_pairs, read_mix

    loop, device, k = block.loop, accelerator.device, block.draft_length
    set_seed(loop.seed)
    forward, new_cache, draft_size, source = load()
    label = functools.partial(label_position, hf_forward(target), forward, new_cache, k=k, device=device)
    splits = {}
    heldout = max(1, round(block.num_positions * block.heldout_fraction))
    for split, count in (("train", block.num_positions), ("eval", heldout)):
        rows = [
            row for pair in (pairs or mix_pairs(distill_dir)) for row in read_mix(distill_dir, pair, split)
        ]
        examples, _ = encode_rows(tokenizer, rows, loop.max_length - k)
        prefixes = sample_positions(examples, count, loop.seed + (split == "eval"))
        splits[split] = flatten(build_labels(folder / "labels", split, prefixes, label, accelerator))
    target_size = target.config.get_text_config().hidden_size
    model = CalibrationModel(target_size, draft_size, block.max_steps).to(device)
    model = fit(accelerator, model, splits["train"], block, folder, tracker, name)
    state = accelerator.get_state_dict(model)  # every process: ZeRO-3 gathers the shards
    report = {
        "drafter": name,
        "drafter_path": source,
        "draft_length": k,
        "positions": {"train": block.num_positions, "heldout": heldout},
        "heldout": calibration_metrics(predict(model, splits["eval"], device), splits["eval"]["labels"]),
        "train": calibration_metrics(predict(model, splits["train"], device), splits["train"]["labels"]),
        "heldout_base_rate_by_step": splits["eval"]["labels"].reshape(-1, k).float().mean(0).tolist(),
    }
    if accelerator.is_main_process:
        saved = CalibrationModel(target_size, draft_size, block.max_steps)
        saved.load_state_dict(state)
        saved.save(folder, extra={"drafter": name, "drafter_path": source, "draft_length": k})
        tracker.log({f"{name}/heldout/{key}": v for key, v in report["heldout"].items()})
    return report


if __name__ == "__main__":
    main()
