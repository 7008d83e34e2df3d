"""Stage `early_exit` (EESD, seed 001 §3.1-3.2): exit layer + norm + head on the target's frozen first N
layers, trained on the distill stage's mix of every pair.

Runner side: `run` launches `main` through `accelerate launch`. Subprocess side: `train_early_exit`
builds the drafter from only the parts of the target it needs (`models.early_exit.build_early_exit`), or
from the whole target for `loss: ce+kl`, and trains its head with `train.early_exit.fit`. Output: `head/`
(`early_exit.safetensors`, `early_exit.json`, whose `training` holds the metrics).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from polydraft.models.early_exit import EarlyExitDrafter, build_early_exit, from_target, save_exit_head
from polydraft.models.loading import load_causal_lm, resolve_dtype
from polydraft.pipelines.runtime.contract import StageContext, StageResult, StageSpec
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.schema.inputs import EarlyExitInputs
from polydraft.pipelines.stages.mix_training import main_on_mix, run_on_mix, start_on_mix
from polydraft.train.early_exit import HEAD_DIR, LOG_FILE, ExitLoss, eval_reference, fit
from polydraft.train.runtime import resolve_attn_implementation
from polydraft.train.stage_metrics import EarlyExitMetrics


def run(inputs: EarlyExitInputs, ctx: StageContext) -> StageResult:
    """Launch the training subprocess, return its metrics."""
    return run_on_mix("early_exit", inputs, ctx, EarlyExitMetrics)


def main(argv: list[str] | None = None) -> None:
    """`python -m pipelines.stages.early_exit SPEC.json`, started by `accelerate launch` on every process."""
    main_on_mix(argv, EarlyExitInputs, lambda inputs: inputs.early_exit, train_early_exit)


def train_early_exit(
    spec: StageSpec, inputs: EarlyExitInputs, accelerator: Any, tracker: Tracker
) -> tuple[EarlyExitDrafter, EarlyExitMetrics]:
    """Build the drafter, train its head, write `head/`; returns the drafter and its metrics."""
    target, block = inputs.target, inputs.early_exit
    loop, device = block.loop, accelerator.device
    start = start_on_mix("early_exit", spec, inputs, block, accelerator, tracker, block.loss_on)
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
    evals = start.evals
    references = eval_reference(
        start.work_dir,
        (target.path, target.revision, target.trust_remote_code),
        [b["input_ids"] for b in evals],
        accelerator,
        frozen_dtype,
        attn,
    )

    if loop.gradient_checkpointing:
        drafter.exit.gradient_checkpointing_enable()
    head, optimization = start.prepare(drafter.exit)
    trained = fit(
        accelerator, drafter, head, optimization, start.batches, (evals, references), start.loop(),
        ExitLoss(teacher, block.kl_weight, block.kl_top_k), start.job(LOG_FILE),
    )  # fmt: skip

    def save(folder: Path, metrics: EarlyExitMetrics, state: dict[str, Any]) -> None:
        save_exit_head(drafter, folder, extra={"training": metrics.model_dump()}, state=state)

    return drafter, start.finish(EarlyExitMetrics, head, trained, HEAD_DIR, save)


if __name__ == "__main__":
    main()
