"""Stage `early_exit` (EESD, seed 001 §3.1-3.2): exit layer + norm + head on the target's frozen first N
layers, trained on the distill stage's mix of every pair.

Runner side: `run` launches `main` through `accelerate launch`. Subprocess side: `train_early_exit`
builds the drafter from only the parts of the target it needs (`models.early_exit.build_early_exit`), or
from the whole target for `loss: ce+kl`, and trains its head with `train.early_exit.fit`. Output: `head/`
(`early_exit.safetensors`, `early_exit.json`, whose `training` holds the metrics).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from polydraft.models.early_exit import EarlyExitDrafter, build_early_exit, from_target, save_exit_head
from polydraft.models.loading import load_causal_lm, load_tokenizer, resolve_dtype
from polydraft.pipelines.schema.inputs import EarlyExitInputs
from polydraft.pipelines.stage import (
    StageContext,
    StageFailed,
    StageResult,
    StageSpec,
    launch_training,
    optim_settings,
    training_main,
)
from polydraft.pipelines.tracking import Tracker
from polydraft.train.data import MixBatches, pad_id_of
from polydraft.train.early_exit import HEAD_DIR, eval_reference, eval_set, fit, load_examples
from polydraft.train.results import EarlyExitMetrics
from polydraft.train.runtime import configure_deepspeed, resolve_attn_implementation
from polydraft.train.schedule import build_optimizer, build_scheduler


def run(inputs: EarlyExitInputs, ctx: StageContext) -> StageResult:
    """Launch the training subprocess, return its metrics."""
    if "distill" not in ctx.upstream:
        raise StageFailed("early_exit trains on the distill stage's mix: enable the distill stage")
    metrics = launch_training(inputs, inputs.launch, ctx, "polydraft.pipelines.stages.early_exit")
    return StageResult(metrics=EarlyExitMetrics.model_validate(metrics).model_dump())


def main(argv: list[str] | None = None) -> None:
    """`python -m pipelines.stages.early_exit SPEC.json`, started by `accelerate launch` on every process."""

    def job(spec: StageSpec, inputs: EarlyExitInputs, accelerator: Any, tracker: Tracker) -> dict[str, Any]:
        return train_early_exit(spec, inputs, accelerator, tracker)[1].model_dump()

    training_main(argv, EarlyExitInputs, lambda inputs: inputs.early_exit.loop, job)


def train_early_exit(
    spec: StageSpec, inputs: EarlyExitInputs, accelerator: Any, tracker: Tracker
) -> tuple[EarlyExitDrafter, EarlyExitMetrics]:
    """Build the drafter, train its head, write `head/`; returns the drafter and its metrics."""
    from accelerate.utils import set_seed

    target, work_dir, block = inputs.target, Path(spec.work_dir), inputs.early_exit
    loop, optim = block.loop, optim_settings(block.optim)
    device = accelerator.device
    set_seed(loop.seed)
    tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
    distill_dir = Path(spec.upstream["distill"])
    options = {"temperatures": block.temperatures, "loss_on": block.loss_on, "max_length": loop.max_length}
    try:
        train_examples = load_examples(distill_dir, tokenizer, "train", **options)
        eval_examples = load_examples(distill_dir, tokenizer, "eval", **options)
    except (FileNotFoundError, ValueError) as err:
        raise StageFailed(f"early_exit: {err}") from err
    batches = MixBatches(
        train_examples, loop.seed, loop.per_device_batch_size, accelerator.process_index,
        accelerator.num_processes, accelerator.gradient_accumulation_steps, pad_id_of(tokenizer),
    )  # fmt: skip
    if batches.steps_per_epoch == 0:
        raise StageFailed(
            f"early_exit: {len(train_examples)} training examples are fewer than one global batch of "
            f"{batches.global_batch} (per_device_batch_size x processes x grad_accum_steps)"
        )
    total_steps = loop.max_steps or max(1, int(loop.epochs * batches.steps_per_epoch))

    attn = resolve_attn_implementation(loop.attn_implementation, device.type == "cuda")
    frozen_dtype = resolve_dtype(target.dtype, device)
    teacher = None
    if block.loss == "ce+kl":  # the whole target, whose first N layers the drafter then shares
        teacher = load_causal_lm(target.path, target.revision, target.dtype, target.trust_remote_code, device)
        teacher.requires_grad_(False)
        drafter = from_target(
            teacher, block.num_shared_layers, block.num_exit_layers, exit_dtype=torch.float32
        )
        drafter.target_path, drafter.target_revision = target.path, target.revision
    else:
        drafter = build_early_exit(
            target.path, block.num_shared_layers, block.num_exit_layers, revision=target.revision,
            dtype=frozen_dtype, exit_dtype=torch.float32, device=device, attn_implementation=attn,
            trust_remote_code=target.trust_remote_code,
        )  # fmt: skip
    evals = eval_set(
        eval_examples, loop.per_device_batch_size, loop.eval_batches, accelerator, pad_id_of(tokenizer)
    )
    references = eval_reference(
        work_dir,
        (target.path, target.revision, target.trust_remote_code),
        [b["input_ids"] for b in evals],
        accelerator,
        frozen_dtype,
        attn,
    )

    head = drafter.exit
    if loop.compile:
        head.compile()
    optimizer = build_optimizer(head, optim.lr, optim.weight_decay, optim.betas, optim.eps)
    scheduler = build_scheduler(
        optimizer, total_steps, optim.warmup_ratio, optim.schedule, optim.min_lr_ratio
    )
    configure_deepspeed(accelerator, loop.per_device_batch_size, optim.max_grad_norm)
    prepared, optimizer = accelerator.prepare(head, optimizer)
    prepared.train()
    steps, train_loss, initial, final = fit(
        accelerator, drafter, prepared, optimizer, scheduler, batches, evals, references, tracker,
        total_steps=total_steps, max_grad_norm=optim.max_grad_norm, log_every=loop.log_every,
        eval_every=loop.eval_every, checkpoint_every=loop.checkpoint_every,
        keep_checkpoints=loop.keep_checkpoints, work_dir=work_dir, quiet=spec.quiet, teacher=teacher,
        kl_top_k=block.kl_top_k, kl_weight=block.kl_weight,
    )  # fmt: skip
    metrics = EarlyExitMetrics(
        steps=steps,
        train_loss=train_loss,
        initial=initial,
        final=final,
        peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    )
    state = accelerator.get_state_dict(prepared)  # every process: FSDP / ZeRO-3 gather the shards
    if accelerator.is_main_process:
        out, partial = work_dir / HEAD_DIR, work_dir / f"{HEAD_DIR}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        save_exit_head(drafter, partial, extra={"training": metrics.model_dump()}, state=state)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        shutil.rmtree(work_dir / "checkpoints", ignore_errors=True)  # the head is written: nothing to resume
    accelerator.wait_for_everyone()
    return drafter, metrics


if __name__ == "__main__":
    main()
