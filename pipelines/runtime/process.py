"""The side of a stage that runs inside its training processes: `training_main` reads the spec, builds the
Accelerator and the wandb run, runs the job and leaves its metrics (or its failure) for the runner side
(`pipelines.runtime.launch`)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polydraft.pipelines.runtime.contract import TRAINING_ERROR, TRAINING_METRICS, StageSpec
from polydraft.pipelines.runtime.tracking import Tracker, start_tracking
from polydraft.pipelines.schema import (
    LoopConfig,
    MemoryLoop,
    OptimConfig,
    TargetLayerLoop,
    TrackingConfig,
)
from polydraft.train.loop import LoopSettings
from polydraft.train.step import OptimSettings


def tracker_for_spec(spec: StageSpec, is_main_process: bool) -> Tracker:
    """The wandb run of a training subprocess (main process only; other ranks log nothing)."""
    tracking = TrackingConfig.model_validate(spec.tracking)
    run_dir = Path(spec.run_dir)
    return start_tracking(
        stage=spec.stage,
        group=tracking.run_name or run_dir.name,
        wandb_dir=run_dir,
        config=spec.inputs,
        project=tracking.project,
        entity=tracking.entity,
        tags=tracking.tags,
        mode=tracking.mode if is_main_process else "disabled",
    )


def optim_settings(optim: OptimConfig) -> OptimSettings:
    """A recipe's optimizer block as the trainers' plain settings (a resolved recipe has every value)."""
    assert optim.lr is not None, "the recipe loader fills every learning rate"
    betas = (optim.betas[0], optim.betas[1])
    return OptimSettings(**{**optim.model_dump(), "betas": betas})


def loop_settings(loop: LoopConfig, total_steps: int) -> LoopSettings:
    """A recipe's loop block as the trainers' plain settings (the loss in chunks: a loop whose loss goes
    through a vocabulary-wide head; gradient checkpointing: a loop that trains layers of the target's
    class)."""
    return LoopSettings(
        total_steps=total_steps,
        per_device_batch_size=loop.per_device_batch_size,
        max_length=loop.max_length,
        log_every=loop.log_every,
        eval_every=loop.eval_every,
        eval_batches=loop.eval_batches,
        checkpoint_every=loop.checkpoint_every,
        keep_checkpoints=loop.keep_checkpoints,
        compile=loop.compile,
        loss_chunk_tokens=loop.loss_chunk_tokens if isinstance(loop, MemoryLoop) else None,
        gradient_checkpointing=isinstance(loop, TargetLayerLoop) and loop.gradient_checkpointing,
    )


def training_main(
    argv: list[str] | None,
    inputs_type: type[Any],
    loop_of: Callable[[Any], LoopConfig],
    job: Callable[[StageSpec, Any, Any, Tracker], dict[str, Any]],
) -> None:
    """The `main()` of a training stage module, started by `accelerate launch` on every process: read the
    spec, build the Accelerator for the stage's loop settings and the wandb run, and run `job(spec, inputs,
    accelerator, tracker)`, which returns the stage's metrics (see `run_training_process`)."""
    import torch

    from polydraft.train.runtime import make_accelerator, resolve_mixed_precision

    spec = StageSpec.read((argv or sys.argv[1:])[0])
    setup_process_logging(spec)
    inputs = inputs_type.model_validate(spec.inputs)
    loop = loop_of(inputs)
    cuda = torch.cuda.is_available() and not inputs.launch.cpu
    accelerator = make_accelerator(
        loop.grad_accum_steps, resolve_mixed_precision(loop.mixed_precision, cuda), spec.collective_timeout_s
    )
    tracker = tracker_for_spec(spec, accelerator.is_main_process)
    run_training_process(spec, accelerator, tracker, lambda: job(spec, inputs, accelerator, tracker))


def configure_logging(quiet: bool, verbose: bool, bars: bool) -> None:
    """polydraft's loggers at INFO (WARNING with `quiet`, DEBUG with `verbose`), other libraries' at
    WARNING, one line format for the runner and its training subprocesses. `bars: False` turns off the
    tqdm bars of transformers, huggingface_hub and datasets (a bar redrawn with carriage returns turns
    into fragments in a pipe or a log file; polydraft's own progress is whole lines, `train.progress`)."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.WARNING
    )
    logging.getLogger("polydraft").setLevel(
        logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    )
    if not bars:
        import datasets
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # huggingface_hub's too
        datasets.disable_progress_bars()


def setup_process_logging(spec: StageSpec) -> None:
    """A training subprocess logs like the runner (its lines are forwarded through a pipe: no bars)."""
    configure_logging(spec.quiet, spec.verbose, bars=False)


def run_training_process(spec: StageSpec, accelerator: Any, tracker: Tracker, train: Any) -> None:
    """Call `train()` in a training subprocess; leave its metrics (or its failure reason) for the runner."""
    work_dir = Path(spec.work_dir)
    try:
        metrics = train()
    except Exception as err:
        if accelerator.is_main_process:
            (work_dir / TRAINING_ERROR).write_text(f"{type(err).__name__}: {err}\n", encoding="utf-8")
        tracker.finish(failed=True)
        raise
    # what accelerate really ran (a GPU-only config falls back to DDP on a CPU: see `cpu_fallback`)
    metrics |= {
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
    }
    if accelerator.is_main_process:
        tmp = work_dir / (TRAINING_METRICS + ".tmp")
        tmp.write_text(json.dumps(metrics, indent=2), encoding="utf-8")
        tmp.replace(work_dir / TRAINING_METRICS)
    tracker.summary(metrics)
    tracker.finish()
    accelerator.end_training()
