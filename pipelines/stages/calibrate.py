"""Stage `calibrate` (seed 001 §3.3, eq. 5): one calibration model per drafter, predicting whether each
draft token is accepted, for Cali-TS draft-length control.

Drafters: the early-exit head (attached to the loaded target, sharing its first N layers) and, with
`calibrate.drafters: all`, every finetuned drafter (`finetune/<pair>/`) on its own pair's rows.

Runner side: `run` launches one process whatever `launch` says (`CalibrateInputs`): labelling needs the
whole target, spread over the visible GPUs. Subprocess side: `calibrate`. Outputs per drafter,
`<work_dir>/<name>/`: the model, `calibration.json` and `report.json` (written last: a drafter with a
report is done and skipped by a rerun).
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from polydraft.data.prompts import MULTILINGUAL
from polydraft.models.calibration import CalibrationModel, calibration_metrics
from polydraft.models.drafters import DrafterMismatch, load_drafter
from polydraft.models.loading import load_tokenizer
from polydraft.models.placement import input_device, load_target, process_device
from polydraft.pipelines.runtime.contract import StageContext, StageFailed, StageResult, StageSpec
from polydraft.pipelines.runtime.launch import launch_training
from polydraft.pipelines.runtime.process import loop_settings, optim_settings, training_main
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.schema.inputs import CalibrateInputs
from polydraft.train.calibrate import (
    REPORT_FILE,
    Forward,
    build_labels,
    fit,
    flatten,
    hf_forward,
    label_position,
    predict,
    sample_positions,
    total_steps,
)
from polydraft.train.data import encode_rows
from polydraft.train.loop import TrainJob
from polydraft.train.stage_metrics import CalibrateMetrics, CalibrationReport

Loader = Callable[[], tuple[Forward, Callable[[], Any], int, str]]
"""Loads a drafter: (forward, new cache, hidden size, where it came from)."""


def run(inputs: CalibrateInputs, ctx: StageContext) -> StageResult:
    """Launch the training subprocess, return the held-out metrics per drafter."""
    for needed in ("distill", "early_exit"):
        if needed not in ctx.upstream:
            raise StageFailed(f"calibrate needs the {needed} stage's output: enable the {needed} stage")
    if inputs.calibrate.drafters == "all" and "finetune" not in ctx.upstream:
        raise StageFailed("calibrate.drafters: all needs the finetune stage; enable it or use `early_exit`")
    metrics = launch_training(inputs, inputs.launch, ctx, "polydraft.pipelines.stages.calibrate")
    return StageResult(metrics=CalibrateMetrics.model_validate(metrics).model_dump())


def main(argv: list[str] | None = None) -> None:
    """`python -m pipelines.stages.calibrate SPEC.json`, started by `accelerate launch`."""
    training_main(argv, CalibrateInputs, lambda inputs: inputs.calibrate.loop, calibrate)


def drafters_of(
    spec: StageSpec, target: torch.nn.Module, inputs: CalibrateInputs
) -> list[tuple[str, Loader, list[str] | None]]:
    """(name, loader, pairs) per drafter; `pairs` None: every pair of the mix (the early-exit head serves
    them all)."""
    from polydraft.models.early_exit import attach_exit_head

    def early_exit() -> tuple[Forward, Callable[[], Any], int, str]:
        head = Path(spec.upstream["early_exit"]) / "head"
        drafter = attach_exit_head(target, head)
        return (
            (lambda ids, cache: drafter(ids, cache=cache)),
            drafter.new_cache,
            target.config.hidden_size,
            str(head),
        )

    out: list[tuple[str, Loader, list[str] | None]] = [("early_exit", early_exit, None)]
    if inputs.calibrate.drafters == "all":
        finetune = Path(spec.upstream["finetune"])
        for folder in sorted(p for p in finetune.iterdir() if (p / "config.json").is_file()):
            # the multilingual drafter (`finetune.multilingual`) serves every pair: it is calibrated on all
            pairs = None if folder.name == MULTILINGUAL else [folder.name]
            out.append((folder.name, functools.partial(standalone, folder, target, inputs), pairs))
    return out


def standalone(
    folder: Path, target: torch.nn.Module, inputs: CalibrateInputs
) -> tuple[Forward, Callable[[], Any], int, str]:
    """A finetuned drafter (Hugging Face folder) on the target's device, checked to share its vocabulary."""
    from transformers import DynamicCache

    reference = next(target.parameters())  # its dtype; a spread target's parameters may sit on `meta`
    spec = inputs.target
    tokenizer = load_tokenizer(spec.path, spec.revision, spec.trust_remote_code)
    try:
        model = load_drafter(
            str(folder),
            None,
            target_vocab_size=target.config.get_text_config().vocab_size,
            target_tokenizer=tokenizer,
            dtype=reference.dtype,
        )
    except DrafterMismatch as err:
        raise StageFailed(f"calibrate: {err}") from err
    model = model.to(input_device(target)).eval()
    return hf_forward(model), DynamicCache, model.config.get_text_config().hidden_size, str(folder)


def calibrate(spec: StageSpec, inputs: CalibrateInputs, accelerator: Any, tracker: Tracker) -> dict[str, Any]:
    """Label, train and report one calibration model per drafter; returns the held-out metrics."""
    target_spec, work_dir = inputs.target, Path(spec.work_dir)
    tokenizer = load_tokenizer(target_spec.path, target_spec.revision, target_spec.trust_remote_code)
    target = load_target(
        target_spec.path, target_spec.revision, target_spec.dtype, target_spec.trust_remote_code,
        target_spec.max_memory_per_gpu_gib, process_device(accelerator.device, accelerator.num_processes),
    )  # fmt: skip
    heldout = {}
    for name, load, pairs in drafters_of(spec, target, inputs):
        folder = work_dir / name
        if not (folder / REPORT_FILE).is_file():  # else done by an earlier, interrupted run
            report = calibrate_drafter(
                accelerator, tracker, inputs, Path(spec.upstream["distill"]), tokenizer, target, name, load,
                pairs, folder,
            )  # fmt: skip
            if accelerator.is_main_process:
                (folder / REPORT_FILE).write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
                shutil.rmtree(folder / "checkpoints", ignore_errors=True)
                shutil.rmtree(folder / "labels", ignore_errors=True)
            accelerator.wait_for_everyone()
            accelerator.free_memory()
        report = CalibrationReport.model_validate_json((folder / REPORT_FILE).read_text(encoding="utf-8"))
        heldout[name] = report.heldout.model_dump()
    return {"heldout": heldout}


def calibrate_drafter(
    accelerator: Any,
    tracker: Tracker,
    inputs: CalibrateInputs,
    distill_dir: Path,
    tokenizer: Any,
    target: torch.nn.Module,
    name: str,
    load: Loader,
    pairs: list[str] | None,
    folder: Path,
) -> CalibrationReport:
    """Labels (train and held-out), the trained model saved in `folder`, and the report."""
    from accelerate.utils import set_seed

    from polydraft.data.mix import mix_pairs, read_mix

    block = inputs.calibrate
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
        try:
            prefixes = sample_positions(examples, count, loop.seed + (split == "eval"))
        except ValueError as err:
            raise StageFailed(f"calibrate {name}: {err}") from err
        splits[split] = flatten(build_labels(folder / "labels", split, prefixes, label, accelerator))
    target_size = target.config.get_text_config().hidden_size
    model = CalibrationModel(target_size, draft_size, block.max_steps).to(device)
    try:
        steps = total_steps(len(splits["train"]["labels"]), loop.per_device_batch_size, accelerator, loop.epochs, loop.max_steps)  # fmt: skip
    except ValueError as err:
        raise StageFailed(f"calibrate {name}: {err}") from err
    job = TrainJob(  # not quiet: --quiet sets the process's log level
        f"calibrate {name}", folder / "checkpoints", folder / "train_log.jsonl", tracker, False, prefix=f"{name}/"
    )  # fmt: skip
    model = fit(accelerator, model, splits["train"], optim_settings(block.optim), loop_settings(loop, steps), loop.seed, job)  # fmt: skip
    state = accelerator.get_state_dict(model)  # every process: ZeRO-3 gathers the shards
    report = CalibrationReport(
        drafter=name,
        drafter_path=source,
        draft_length=k,
        positions={"train": block.num_positions, "heldout": heldout},
        heldout=calibration_metrics(predict(model, splits["eval"], device), splits["eval"]["labels"]),
        train=calibration_metrics(predict(model, splits["train"], device), splits["train"]["labels"]),
        heldout_base_rate_by_step=splits["eval"]["labels"].reshape(-1, k).float().mean(0).tolist(),
    )
    if accelerator.is_main_process:
        saved = CalibrationModel(target_size, draft_size, block.max_steps)
        saved.load_state_dict(state)
        saved.save(folder, extra={"drafter": name, "drafter_path": source, "draft_length": k})
        tracker.log({f"{name}/heldout/{key}": v for key, v in report.heldout.model_dump().items()})
    return report


if __name__ == "__main__":
    main()
