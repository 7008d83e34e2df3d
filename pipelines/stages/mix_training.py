"""What the stages that train on the distill stage's mix share. `sized_batches` cuts encoded mix rows into
this process's batches and sizes the run (finetune, early_exit, heads). The `early_exit` and `heads`
stages both train a small part (an exit head, proposal heads) on a frozen target over the mix of every
pair, with the same skeleton: `run_on_mix` launches the training subprocess and reads its metrics,
`start_on_mix` seeds it and reads its share of the mix (`mix_data`) and its held-out batches,
`train.runtime.prepare_for_training` builds the optimizer and schedule and hands the trainable part to
accelerate, `write_output` writes the output folder atomically and drops the checkpoints it makes useless.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from polydraft.pipelines.runtime.contract import StageContext, StageFailed, StageResult, StageSpec
from polydraft.pipelines.runtime.launch import launch_training
from polydraft.pipelines.runtime.process import training_main
from polydraft.train.data import MixBatches, pad_id_of
from polydraft.train.evaluation import eval_set
from polydraft.train.mix_cache import load_examples

log = logging.getLogger(__name__)

MIX_CACHE = "mix_cache"
"""The folder, in a stage's work dir, of its tokenized mix (`train.mix_cache`)."""


def run_on_mix(stage: str, inputs: Any, ctx: StageContext, metrics: type[BaseModel]) -> StageResult:
    """Runner side of a stage that trains one model on the distill stage's mix: launch its training
    subprocess (`python -m polydraft.pipelines.stages.<stage>`) and return its metrics, as `metrics`
    reads them."""
    if "distill" not in ctx.upstream:
        raise StageFailed(f"{stage} trains on the distill stage's mix: enable the distill stage")
    found = launch_training(inputs, inputs.launch, ctx, f"polydraft.pipelines.stages.{stage}")
    return StageResult(metrics=metrics.model_validate(found).model_dump())


def main_on_mix(
    argv: list[str] | None,
    inputs_type: type[BaseModel],
    block_of: Callable[[Any], Any],
    train: Callable[..., Any],
) -> None:
    """Subprocess side of such a stage, on every process `accelerate launch` starts: `train(spec, inputs,
    accelerator, tracker)` returns (the trained model, its metrics); the metrics go back to the runner."""

    def job(spec: StageSpec, inputs: Any, accelerator: Any, tracker: Any) -> dict[str, Any]:
        return train(spec, inputs, accelerator, tracker)[1].model_dump()

    training_main(argv, inputs_type, lambda inputs: block_of(inputs).loop, job)


@dataclass
class MixStart:
    """What a process of such a stage starts from."""

    tokenizer: Any
    batches: MixBatches
    """This process's training batches."""
    evals: list[dict[str, torch.Tensor]]
    """This process's held-out batches (`train.evaluation.eval_set`)."""
    total_steps: int


def start_on_mix(
    stage: str, spec: StageSpec, inputs: Any, block: Any, accelerator: Any, loss_on: str
) -> MixStart:
    """Seed the process (`block.loop.seed`), load the target's tokenizer, read this process's share of the
    mix at `block.temperatures` and its held-out batches."""
    from accelerate.utils import set_seed

    from polydraft.models.loading import load_tokenizer

    target, loop = inputs.target, block.loop
    set_seed(loop.seed)
    tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
    batches, eval_examples, total_steps = mix_data(
        stage, Path(spec.upstream["distill"]), Path(spec.work_dir), tokenizer, loop, accelerator,
        temperatures=block.temperatures, loss_on=loss_on, max_length=loop.max_length,
    )  # fmt: skip
    pad_id = pad_id_of(tokenizer)
    evals = eval_set(eval_examples, loop.per_device_batch_size, loop.eval_batches, accelerator, pad_id)
    return MixStart(tokenizer, batches, evals, total_steps)


def mix_data(
    stage: str, distill_dir: Path, work_dir: Path, tokenizer: Any, loop: Any, accelerator: Any, **options: Any
) -> tuple[MixBatches, list[dict[str, list[int]]], int]:
    """(training batches of this process, held-out examples, total optimizer steps). The mix of every
    pair is tokenized once, into `<work_dir>/mix_cache` (`train.mix_cache`). `options`: `load_examples`'
    (temperatures, loss_on, max_length). StageFailed when the mix is missing or holds less than one
    global batch."""
    cache = {"cache_dir": work_dir / MIX_CACHE, "main_process_first": accelerator.main_process_first}
    splits = {}
    try:
        for split in ("train", "eval"):
            splits[split] = load_examples(distill_dir, tokenizer, split, **options, **cache)
    except (FileNotFoundError, ValueError) as err:
        raise StageFailed(f"{stage}: {err}") from err
    for split, mix in splits.items():
        if mix.dropped:
            log.info("%s: %d %s rows left no response token within max_length", stage, mix.dropped, split)
    batches, total_steps = sized_batches(
        stage, splits["train"].examples, loop.seed, loop, accelerator, pad_id_of(tokenizer)
    )
    # the held-out split is small: eval batches are cut from a list
    return batches, splits["eval"].examples.to_list(), total_steps


def sized_batches(
    stage: str, examples: Sequence[dict[str, list[int]]], seed: int, loop: Any, accelerator: Any, pad_id: int
) -> tuple[MixBatches, int]:
    """(this process's batches of `examples`, total optimizer steps: `loop.max_steps`, else `loop.epochs`
    passes). StageFailed when the examples do not fill one global batch."""
    batches = MixBatches(
        examples, seed, loop.per_device_batch_size, accelerator.process_index, accelerator.num_processes,
        accelerator.gradient_accumulation_steps, pad_id, loop.group_by_length,
    )  # fmt: skip
    if batches.steps_per_epoch == 0:
        raise StageFailed(
            f"{stage}: {len(examples)} training examples are fewer than one global batch of "
            f"{batches.global_batch} (per_device_batch_size x processes x grad_accum_steps)"
        )
    return batches, loop.max_steps or max(1, int(loop.epochs * batches.steps_per_epoch))


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def write_output(
    accelerator: Any,
    work_dir: Path,
    name: str,
    save: Callable[[Path], None],
    checkpoints: str = "checkpoints",
) -> None:
    """`save(folder)` into `<work_dir>/<name>.partial` on the main process, renamed to `<name>` when
    complete; its checkpoints (`<work_dir>/<checkpoints>`) go then (nothing is left to resume). Every
    process calls this."""
    if accelerator.is_main_process:
        out, partial = work_dir / name, work_dir / f"{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        save(partial)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        shutil.rmtree(work_dir / checkpoints, ignore_errors=True)
    accelerator.wait_for_everyone()
