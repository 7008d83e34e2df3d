"""What the stages that train on the distill stage's mix share. `sized_batches` cuts encoded mix rows into
this process's batches and sizes the run (finetune, early_exit, heads, eagle3).

The `finetune` and `eagle3` stages train one model per pair (and a `multilingual` one): `pair_jobs` names
them, `unfinished` leaves out those an earlier, interrupted run finished (their `metrics_path` is
written, `write_metrics`), `read_metrics` reads them back.

The `early_exit` and `heads` stages both train a small part (an exit head, proposal heads) on a frozen
target over the mix of every pair, with the same skeleton: `run_on_mix` launches the training subprocess
and reads its metrics, `main_on_mix` is that subprocess, `start_on_mix` seeds it and reads its share of
the mix (`mix_data`) and its held-out batches; its `MixStart` then hands the trainable part to accelerate
with its optimizer and schedule (`prepare`), says where the run lives (`job`) and writes the output folder
atomically, dropping the checkpoints it makes useless (`finish`, `write_output`).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from pydantic import BaseModel

from polydraft.data.prompts import MULTILINGUAL
from polydraft.pipelines.runtime.contract import StageContext, StageFailed, StageResult, StageSpec
from polydraft.pipelines.runtime.launch import launch_training
from polydraft.pipelines.runtime.process import loop_settings, optim_settings, training_main
from polydraft.train.data import MixBatches, pad_id_of
from polydraft.train.evaluation import eval_set
from polydraft.train.loop import LoopResult, LoopSettings, TrainJob
from polydraft.train.mix_cache import load_examples
from polydraft.train.runtime import prepare_for_training

log = logging.getLogger(__name__)

MIX_CACHE = "mix_cache"
"""The folder, in a stage's work dir, of its tokenized mix (`train.mix_cache`)."""

M = TypeVar("M", bound=BaseModel)


def require_distill(stage: str, ctx: StageContext) -> None:
    """StageFailed unless the distill stage, whose mix the stage trains on, runs before it."""
    if "distill" not in ctx.upstream:
        raise StageFailed(f"{stage} trains on the distill stage's mix: enable the distill stage")


# ----------------------------------------------------------------------------- one model per pair


def pair_jobs(pairs: Sequence[str], multilingual: bool) -> list[str]:
    """The models a per-pair stage trains, in order: one per pair, then with `multilingual` one on the
    balanced union of every pair's mix."""
    return [*pairs, MULTILINGUAL] if multilingual else list(pairs)


def metrics_path(work_dir: Path | str, name: str) -> Path:
    """`<name>.metrics.json` (a pair's, or `multilingual.metrics.json`), written once the model `name` is
    saved: it is done."""
    return Path(work_dir) / f"{name}.metrics.json"


def write_metrics(accelerator: Any, work_dir: Path, name: str, metrics: BaseModel) -> None:
    """The model `name`'s metrics file, from the main process (the last thing its training writes)."""
    if accelerator.is_main_process:
        metrics_path(work_dir, name).write_text(metrics.model_dump_json(indent=2), encoding="utf-8")


def read_metrics(work_dir: Path, name: str, kind: type[M]) -> M:
    return kind.model_validate_json(metrics_path(work_dir, name).read_text(encoding="utf-8"))


def unfinished(stage: str, inputs: Any, ctx: StageContext, jobs: list[str]) -> Any | None:
    """Runner side of a per-pair stage: its inputs with `done` naming the jobs an earlier, interrupted run
    finished (their metrics files are written), which the training process skips; None when every job is
    done. StageFailed without the distill stage."""
    require_distill(stage, ctx)
    done = [job for job in jobs if metrics_path(ctx.work_dir, job).is_file()]
    return inputs.model_copy(update={"done": done}) if len(done) < len(jobs) else None


# ----------------------------------------------------------------------------- one model on every pair


def run_on_mix(stage: str, inputs: Any, ctx: StageContext, metrics: type[BaseModel]) -> StageResult:
    """Runner side of a stage that trains one model on the distill stage's mix: launch its training
    subprocess (`python -m polydraft.pipelines.stages.<stage>`) and return its metrics, as `metrics`
    reads them."""
    require_distill(stage, ctx)
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
    """What a process of such a stage starts from, and the steps around its trainer's `fit`."""

    stage: str
    work_dir: Path
    block: Any
    """The stage's recipe block (its `optim` and `loop`)."""
    accelerator: Any
    tracker: Any
    quiet: bool
    tokenizer: Any
    batches: MixBatches
    """This process's training batches."""
    evals: list[dict[str, torch.Tensor]]
    """This process's held-out batches (`train.evaluation.eval_set`)."""
    total_steps: int

    def prepare(self, trainable: torch.nn.Module) -> tuple[torch.nn.Module, tuple[Any, Any, float]]:
        """(`trainable` prepared by `train.runtime.prepare_for_training`, the `optimization` a trainer's
        `fit` takes: its optimizer, LR scheduler and max_grad_norm)."""
        optim, loop = optim_settings(self.block.optim), self.block.loop
        prepared, optimizer, scheduler = prepare_for_training(
            trainable, optim, self.total_steps, loop.per_device_batch_size, self.accelerator, loop.compile
        )
        return prepared, (optimizer, scheduler, optim.max_grad_norm)

    def loop(self) -> LoopSettings:
        return loop_settings(self.block.loop, self.total_steps)

    def job(self, log_file: str) -> TrainJob:
        """The run's checkpoints under `<work_dir>/checkpoints`, its step log `<work_dir>/<log_file>`."""
        return TrainJob(
            self.stage, self.work_dir / "checkpoints", self.work_dir / log_file, self.tracker, self.quiet
        )

    def finish(
        self,
        kind: type[M],
        prepared: torch.nn.Module,
        trained: tuple[LoopResult, Any, Any],
        name: str,
        save: Callable[[Path, M, dict[str, Any]], None],
    ) -> M:
        """The run's metrics (`kind`, from `fit`'s loop result and held-out metrics before and after
        training), after `save(folder, metrics, state)` wrote the output folder `<work_dir>/<name>`
        (`write_output`; `state`: the trained weights, gathered on every process)."""
        result, initial, final = trained
        metrics = kind(
            steps=result.steps, train_loss=result.train_loss, initial=initial, final=final,
            peak_memory_gib=peak_memory_gib(self.accelerator.device),
        )  # fmt: skip
        state = self.accelerator.get_state_dict(prepared)  # every process: FSDP / ZeRO-3 gather the shards
        write_output(self.accelerator, self.work_dir, name, lambda folder: save(folder, metrics, state))
        return metrics


def start_on_mix(
    stage: str, spec: StageSpec, inputs: Any, block: Any, accelerator: Any, tracker: Any, loss_on: str
) -> MixStart:
    """Seed the process (`block.loop.seed`), load the target's tokenizer, read this process's share of the
    mix at `block.temperatures` and its held-out batches."""
    from accelerate.utils import set_seed

    from polydraft.models.loading import load_tokenizer

    target, loop, work_dir = inputs.target, block.loop, Path(spec.work_dir)
    set_seed(loop.seed)
    tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
    batches, eval_examples, total_steps = mix_data(
        stage, Path(spec.upstream["distill"]), work_dir, tokenizer, loop, accelerator,
        temperatures=block.temperatures, loss_on=loss_on, max_length=loop.max_length,
    )  # fmt: skip
    pad_id = pad_id_of(tokenizer)
    evals = eval_set(eval_examples, loop.per_device_batch_size, loop.eval_batches, accelerator, pad_id)
    return MixStart(
        stage, work_dir, block, accelerator, tracker, spec.quiet, tokenizer, batches, evals, total_steps
    )


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
