"""The training loop every trainer runs: resume, steps, the per-step log, progress, eval, checkpoints.

Pretrain, finetune (`train.drafter`), the early-exit head (`train.early_exit`), the Medusa / BPD heads
(`train.heads`), the EAGLE-3 heads (`train.eagle3`) and the calibration MLP (`train.calibrate`) differ in
their model, data, loss and eval metric; they hand those to `TrainingLoop` as callables and the loop does
everything else the same way:

- `resume()` loads the newest checkpoint that loads (a damaged one is named and the previous one used),
  truncates the step log to its step, and gives the trainer its own saved state back;
- `run()` steps until `total_steps`: each step's entry goes to the step log (`StepLog`), every
  `log_every` steps one readable line goes to the console (step/total, epoch, loss, lr, throughput,
  time left), every `eval_every` steps the trainer's eval runs, every `checkpoint_every` steps (and at
  the last) a checkpoint is written with the trainer's state, the tokens seen and the scheduler; before
  each step, torch's threads follow the runner's share of the CPU cores (`train.runtime.CoreShare`).

The heads' trainers (early exit, Medusa / BPD, EAGLE-3) also share what surrounds the loop,
`run_with_evals`: the held-out eval of the untrained head (kept in the checkpoints, so that a resumed run
reports the same baseline), periodic evals, the final eval, and the step log's throughput accounting.

For the resume tests, `POLYDRAFT_TEST_KILL_AFTER_STEP=N` makes the main process SIGKILL its process
group right after step N's log entry is written (before that step's eval or checkpoint): a kill at a
chosen step, with no timing involved. Start such a run in its own session (its own process group).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from polydraft.train.checkpoint import resume_checkpoint, save_checkpoint
from polydraft.train.progress import ProgressLine
from polydraft.train.runtime import CoreShare, check_finite
from polydraft.train.step import StepLog, StepStats
from polydraft.train.steplog import mean_loss, truncate_log

log = logging.getLogger(__name__)

KILL_ENV = "POLYDRAFT_TEST_KILL_AFTER_STEP"


@dataclass(frozen=True)
class LoopSettings:
    """What the loop does besides stepping, as plain values (a stage builds this from its recipe block,
    `pipelines.runtime.process.loop_settings`)."""

    total_steps: int
    per_device_batch_size: int
    max_length: int
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    keep_checkpoints: int
    compile: bool = False
    loss_chunk_tokens: int | None = None
    """`train.chunked_loss`'s chunk size; None: the full logits."""
    gradient_checkpointing: bool = False

    @property
    def plan(self) -> LoopPlan:
        return LoopPlan(
            self.total_steps, self.log_every, self.eval_every, self.checkpoint_every, self.keep_checkpoints
        )


@dataclass(frozen=True)
class LoopPlan:
    """How long the loop runs and how often it logs, evaluates and saves."""

    total_steps: int
    log_every: int
    eval_every: int
    """0: no periodic eval (the trainer may still evaluate at the end)."""
    checkpoint_every: int
    keep_checkpoints: int


@dataclass(frozen=True)
class LoopResult:
    steps: int
    tokens: int
    """Input tokens (or rows, for the calibration MLP) seen over the whole run, resumed parts included."""
    train_loss: float | None
    """Mean loss of the last `log_every` steps."""


class TrainingLoop:
    """One run of optimizer steps with its checkpoints under `checkpoints` and its log at `log_path`."""

    def __init__(
        self,
        accelerator: Any,
        plan: LoopPlan,
        *,
        label: str,
        checkpoints: Path,
        log_path: Path,
        scheduler: Any,
        quiet: bool,
    ) -> None:
        self.accelerator, self.plan, self.label = accelerator, plan, label
        self.checkpoints, self.log_path, self.scheduler, self.quiet = checkpoints, log_path, scheduler, quiet
        self.step, self.tokens = 0, 0
        self.last_checkpoint: Path | None = None

    def resume(self) -> dict[str, Any] | None:
        """Restore the newest loadable checkpoint (model, optimizer, RNG states, scheduler) and return the
        state the trainer saved with it, or None for a fresh run."""
        resumed = resume_checkpoint(self.accelerator, self.checkpoints, {"scheduler": self.scheduler})
        saved = None
        if resumed is not None:
            self.last_checkpoint, saved = resumed
            self.step, self.tokens = saved["step"], saved.get("tokens", 0)
            log.info(
                "[%s] resuming from %s (step %d of %d)",
                self.label, self.last_checkpoint, self.step, self.plan.total_steps,
            )  # fmt: skip
        if self.accelerator.is_main_process:
            truncate_log(self.log_path, self.step)
        return saved

    def run(
        self,
        train_step: Callable[[int], StepStats],
        steplog: StepLog,
        *,
        evaluate: Callable[[int], None] | None = None,
        state: Callable[[], dict[str, Any]] = dict,
        epoch: Callable[[int], float] | None = None,
        throughput_unit: str = "tokens",
    ) -> LoopResult:
        """Step from the resumed step to the end. `train_step(i)` runs optimizer step i (0-based) and
        returns its stats; `evaluate(step)` logs a periodic eval; `state()` is the trainer's part of a
        checkpoint; `epoch(step)` the epochs done after `step` steps, for the console line."""
        plan, main_process = self.plan, self.accelerator.is_main_process
        kill_after = int(os.environ.get(KILL_ENV, "0") or 0)
        progress = ProgressLine(
            self.label, plan.total_steps, "step", initial=self.step, enabled=main_process and not self.quiet
        )
        cores = CoreShare.from_env()
        while self.step < plan.total_steps:
            threads = cores.follow()
            if threads is not None and main_process:
                log.info("[%s] %d CPU threads a process from step %d on: the stages beside it changed",
                         self.label, threads, self.step + 1)  # fmt: skip
            stats = train_step(self.step)
            check_finite(
                stats.loss, self.step + 1, str(self.last_checkpoint) if self.last_checkpoint else None
            )
            self.step += 1
            self.tokens += stats.input_tokens
            window = steplog.record(self.step, plan.total_steps, stats, self.tokens)
            progress.done = self.step
            if window is not None:
                fields = {} if epoch is None else {"epoch": round(epoch(self.step), 2)}
                fields |= {"loss": window["train/loss"], "lr": window["train/lr"]}
                progress.show(**fields, **{f"{throughput_unit}/s": window["train/tokens_per_s"]})
            if main_process and self.step == kill_after:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            if (
                evaluate
                and plan.eval_every
                and self.step % plan.eval_every == 0
                and self.step < plan.total_steps
            ):
                evaluate(self.step)
            if self.step % plan.checkpoint_every == 0 or self.step == plan.total_steps:
                self.last_checkpoint = save_checkpoint(
                    self.accelerator, self.checkpoints, self.step, {**state(), "tokens": self.tokens},
                    plan.keep_checkpoints, {"scheduler": self.scheduler},
                )  # fmt: skip
        return LoopResult(self.step, self.tokens, mean_loss(self.log_path, plan.log_every))


# ----------------------------------------------------------------------------- the heads' trainers

Metrics = TypeVar("Metrics", bound=BaseModel)


@dataclass(frozen=True)
class TrainJob:
    """Where one trainer's run lives and how it is reported: checkpoints under `checkpoints`, the step log
    at `log_path`, console lines labelled `label`, tracker metrics under `prefix` from step `step_offset`
    on (several heads trained one after the other share one tracker)."""

    label: str
    checkpoints: Path
    log_path: Path
    tracker: Any
    quiet: bool
    prefix: str = ""
    step_offset: int = 0

    @classmethod
    def beside(
        cls, output: Path, label: str, tracker: Any, quiet: bool, prefix: str = "", step_offset: int = 0
    ) -> TrainJob:
        """A job whose checkpoints and step log sit beside its output folder: `<output>.checkpoints/` and
        `<output>.train_log.jsonl` (the drafters, the EAGLE-3 heads: several jobs in one stage folder)."""
        return cls(
            label, output.with_name(output.name + ".checkpoints"), output.with_name(output.name + ".train_log.jsonl"),
            tracker, quiet, prefix, step_offset,
        )  # fmt: skip


@dataclass(frozen=True)
class HeldOut(Generic[Metrics]):
    """A trainer's held-out eval: `measure()` gives the metrics, `report(metrics)` what the tracker gets
    (the job's prefix added), `kind` their type (how a checkpoint's saved baseline is read back)."""

    measure: Callable[[], Metrics]
    report: Callable[[Metrics], dict[str, float]]
    kind: type[Metrics]


def run_with_evals(
    accelerator: Any,
    loop: LoopSettings,
    job: TrainJob,
    scheduler: Any,
    one_step: Callable[[int], StepStats],
    held_out: HeldOut[Metrics] | None,
    flops_per_token: float,
    epoch: Callable[[int], float] | None,
) -> tuple[LoopResult, Metrics | None, Metrics | None]:
    """Resume, evaluate the untrained model on a fresh run (a resumed one reads that baseline from its
    checkpoint), run the loop with the periodic evals, evaluate at the end. Returns the loop's result and
    the held-out metrics before and after training (None without `held_out`). `flops_per_token`: what a
    step costs per input token, for the step log's MFU."""
    main_process = accelerator.is_main_process
    training = TrainingLoop(
        accelerator, loop.plan, label=job.label, checkpoints=job.checkpoints, log_path=job.log_path,
        scheduler=scheduler, quiet=job.quiet,
    )  # fmt: skip
    saved = training.resume()

    def evaluate(step: int) -> Metrics:
        assert held_out is not None
        metrics = held_out.measure()
        if main_process:
            report = {job.prefix + k: v for k, v in held_out.report(metrics).items()}
            job.tracker.log(report, step=job.step_offset + step)
        return metrics

    initial = None
    if saved is not None:
        if held_out is not None and saved["initial_eval"]:
            initial = held_out.kind.model_validate(saved["initial_eval"])
    elif held_out is not None:  # the model as initialised: the baseline training must beat
        initial = evaluate(0)
    steplog = StepLog(
        job.tracker, job.log_path, prefix=job.prefix, log_every=loop.log_every, flops_per_token=flops_per_token,
        peak_flops=None, world=accelerator.num_processes, main_process=main_process, step_offset=job.step_offset,
    )  # fmt: skip
    result = training.run(
        one_step,
        steplog,
        evaluate=evaluate if held_out is not None else None,
        state=lambda: {"initial_eval": initial.model_dump() if initial is not None else None},
        epoch=epoch,
    )
    final = evaluate(result.steps) if held_out is not None else None
    return result, initial, final
