"""What a stage sees: its context (folders, tracker, launcher), what it returns, and the spec its training
subprocesses read.

A stage is a function `run(inputs, ctx) -> StageResult`, where `inputs` is its frozen, typed inputs
object (`pipelines.schema.inputs`): exactly the recipe values it reads. It writes everything into `ctx.work_dir`
(`<run_dir>/<stage>.partial/`); the runner renames that folder to `<run_dir>/<stage>/` only after the
stage returned and its manifest was written, so a folder without `.partial` is always complete. The
partial folder survives a crash or a kill, so a rerun of the same config can resume from what it holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from polydraft.pipelines.runtime.nodes import NodeLeader
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.schema import (
    Recipe,
    ResolvedTarget,
    TrackingConfig,
)
from polydraft.train.progress import ProgressLine

PROJECT_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class StageFailed(RuntimeError):
    """A stage that cannot complete; the message says why and what to do about it."""


@dataclass
class StageResult:
    """Headline metrics of a stage, copied into its manifest (and the run summary)."""

    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageContext:
    name: str
    run_dir: Path
    work_dir: Path
    """Write outputs here. Kept across a crash so that a rerun can resume; renamed on success."""
    upstream: dict[str, Path]
    """Completed folders of the upstream stages this stage consumes, by stage name (enabled ones only)."""
    tracker: Tracker
    tracking: TrackingConfig
    """The recipe's tracking block, for the wandb runs of training subprocesses."""
    quiet: bool = False
    verbose: bool = False
    leader: NodeLeader | None = None
    """Node 0 of several (`pipelines/runtime/nodes.py`): training launches, distillation engines and measure
    processes are announced to the other nodes."""
    in_process: bool = False
    """Run a one-process training launch inside this process (`pipelines.runtime.launch.run_in_process`)
    instead of starting `accelerate launch` (`polydraft run --in-process`, `polydraft study --quick`)."""
    cpu_cores: int | None = None
    """CPU cores this stage's training processes share (`--num_cpu_threads_per_process` is this divided by
    the processes of a node); None: the machine's. Fewer while stages run side by side
    (`runner.parallel_stages`)."""
    cores_file: Path | None = None
    """While stages run side by side: the file into which the runner writes this stage's share of the
    cores whenever the stages beside it change, which its training processes follow
    (`train.runtime.CoreShare`)."""

    def progress(self, total: int, verb: str, unit: str, initial: int = 0) -> ProgressLine:
        """A line of progress every 5% of `total` units, with the rate and the time left (none with
        --quiet): `update(n)` counts units done."""
        return ProgressLine(self.name, total, unit, initial=initial, verb=verb, enabled=not self.quiet)

    def track(self, items: list[T], verb: str, unit: str) -> Iterator[T]:
        """The items, one at a time, with a `progress` line as they are done."""
        progress = self.progress(len(items), verb, unit)
        for item in items:
            yield item
            progress.update()


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Any, StageContext], StageResult]
    """`run(inputs, ctx)`, `inputs` being what `inputs` builds."""
    inputs: Callable[[Recipe, ResolvedTarget], BaseModel]
    """Builds the stage's frozen inputs object from the recipe; its content is the stage's key."""
    upstream: tuple[str, ...] = ()
    """Stages whose outputs it consumes, when they are enabled."""
    side_by_side: bool = False
    """May run beside other such stages (`runner.parallel_stages`): the training stages, whose launches take
    the share of the cores they are given. The others (distill's engines, measure's processes, export's
    checks) spread their work over the whole machine themselves and run alone."""


# ----------------------------------------------------------------------------- training subprocesses


@dataclass
class StageSpec:
    """Everything a training subprocess needs, written as JSON by the runner side of a stage."""

    stage: str
    run_dir: str
    work_dir: str
    upstream: dict[str, str]
    inputs: dict[str, Any]
    """The stage's inputs object (`pipelines.schema.inputs`), as JSON."""
    tracking: dict[str, Any]
    quiet: bool = False
    verbose: bool = False
    collective_timeout_s: float | None = None
    """torch.distributed's timeout for the training processes (`collective_timeout`); None: torch's."""

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(self.__dict__, indent=2), encoding="utf-8")
        return path

    @classmethod
    def read(cls, path: str | Path) -> StageSpec:
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))


def spec_for(inputs: BaseModel, ctx: StageContext, collective_timeout_s: float | None = None) -> StageSpec:
    return StageSpec(
        stage=ctx.name,
        run_dir=str(ctx.run_dir),
        work_dir=str(ctx.work_dir),
        upstream={k: str(v) for k, v in ctx.upstream.items()},
        inputs=inputs.model_dump(mode="json"),
        tracking=ctx.tracking.model_dump(mode="json"),
        quiet=ctx.quiet,
        verbose=ctx.verbose,
        collective_timeout_s=collective_timeout_s,
    )


TRAINING_METRICS = "metrics.json"
"""Headline metrics a training subprocess leaves in the work dir for the runner side."""
TRAINING_ERROR = "error.txt"
"""The subprocess's own one-line reason for failing (NaN at step N, vocabulary mismatch, ...)."""
