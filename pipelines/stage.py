"""What a stage sees: its context (folders, tracker, launcher) and what it returns.

A stage is a function `run(inputs, ctx) -> StageResult`, where `inputs` is its frozen, typed inputs
object (`pipelines.schema.inputs`): exactly the recipe values it reads. It writes everything into `ctx.work_dir`
(`<run_dir>/<stage>.partial/`); the runner renames that folder to `<run_dir>/<stage>/` only after the
stage returned and its manifest was written, so a folder without `.partial` is always complete. The
partial folder survives a crash or a kill, so a rerun of the same config can resume from what it holds.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from polydraft.pipelines.nodes import Machines, NodeLeader, processes_per_node
from polydraft.pipelines.schema import (
    LaunchConfig,
    LoopConfig,
    MemoryLoop,
    OptimConfig,
    Recipe,
    ResolvedTarget,
    TargetLayerLoop,
    TrackingConfig,
)
from polydraft.pipelines.tracking import Tracker, start_tracking
from polydraft.train.loop import LoopSettings
from polydraft.train.progress import ProgressLine
from polydraft.train.step import OptimSettings

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
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
    """Node 0 of several (`pipelines/nodes.py`): training launches, distillation engines and measure
    processes are announced to the other nodes."""

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


def collective_timeout(launch: LaunchConfig, upstream: dict[str, Path]) -> tuple[float, str]:
    """(seconds, why) of the training processes' collective timeout: `launch.collective_timeout_s`, else the
    longer of 30 minutes and 3 times rank 0's estimated time alone tokenizing the mix (`distill/mix/`)."""
    from polydraft.pipelines.plan_model import COLLECTIVE_TIMEOUT_S, TOKENIZE_BYTES_PER_S

    if launch.collective_timeout_s is not None:
        return float(launch.collective_timeout_s), "launch.collective_timeout_s"
    mix = Path(upstream["distill"]) / "mix" if "distill" in upstream else None
    size = sum(p.stat().st_size for p in mix.glob("*/*.jsonl")) if mix is not None and mix.is_dir() else 0
    alone = size / TOKENIZE_BYTES_PER_S
    why = f"rank 0 alone tokenizes the {size / 1e6:.1f} MB mix in ~{alone:.0f} s"
    if 3 * alone > COLLECTIVE_TIMEOUT_S:
        return 3 * alone, f"3 times the longest step rank 0 takes alone: {why}"
    return COLLECTIVE_TIMEOUT_S, f"at least 30 minutes ({why})"


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


def resolve_accelerate_config(path: str) -> Path:
    """A config path as given, else relative to the project (`recipes/accelerate/...`)."""
    for candidate in (Path(path), PROJECT_ROOT / path):
        if candidate.is_file():
            return candidate.resolve()
    raise StageFailed(f"launch.accelerate_config: no such file {path!r} (see recipes/accelerate/)")


def cpu_fallback(config_file: Path) -> str | None:
    """Why a GPU-only accelerate config does not do what it says on a CPU machine, or None.

    With ACCELERATE_USE_CPU, accelerate runs an FSDP or DeepSpeed config's processes as plain gloo DDP
    (checked with accelerate 1.15: `distributed_type` MULTI_CPU, the model wrapped in
    DistributedDataParallel), so nothing is sharded.
    """
    kind = (yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}).get("distributed_type")
    if kind not in ("FSDP", "DEEPSPEED"):
        return None
    return (
        f"{config_file.name} asks for {kind}, which needs GPUs: on this CPU machine accelerate runs its "
        "processes as plain DDP (gloo), with parameters, gradients and optimizer state replicated, not sharded"
    )


def accelerate_command(
    config_file: Path,
    num_processes: int | None,
    module: str,
    args: list[str],
    machines: Machines | None = None,
) -> list[str]:
    """`accelerate launch` of `module`: `num_processes` over all nodes (None: the config's); on several
    nodes, this node's rank among them and node 0's address (else the config's). Each process gets its
    share of this node's cores (`--num_cpu_threads_per_process`; accelerate would set OMP_NUM_THREADS=1,
    which on a CPU machine left every training step on one core), unless OMP_NUM_THREADS is set."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    if machines is not None:
        command += ["--num_machines", str(machines.nodes), "--machine_rank", str(machines.rank)]
        if machines.main_ip is not None:
            command += ["--main_process_ip", machines.main_ip]
        if machines.main_port is not None:
            command += ["--main_process_port", str(machines.main_port)]
    if "OMP_NUM_THREADS" not in os.environ:
        nodes = machines.nodes if machines is not None else 1
        per_node = (
            num_processes // nodes if num_processes is not None else processes_per_node(config_file, None)
        )
        threads = max(1, (os.cpu_count() or 1) // max(1, per_node))
        command += ["--num_cpu_threads_per_process", str(threads)]
    return [*command, "-m", module, *args]


def training_env(cpu: bool, extra: dict[str, str], config_file: Path, name: str) -> dict[str, str]:
    """The environment of a training launch: on a machine without a GPU (or with `launch.cpu`),
    ACCELERATE_USE_CPU=true turns a multi-process config into real gloo DDP ranks."""
    import torch

    env = {**os.environ, **extra}
    if cpu or not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"
        fallback = cpu_fallback(config_file)
        if fallback:
            log.warning("[%s] %s", name, fallback)
    return env


def run_logged(command: list[str], env: dict[str, str], log_path: Path, quiet: bool) -> int:
    """Run `command`, its output appended to `log_path` and (unless `quiet`) shown; returns its status."""
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert process.stdout is not None
        for line in process.stdout:
            log_file.write(line)
            log_file.flush()
            if not quiet:
                sys.stderr.buffer.write(line)
                sys.stderr.flush()
        return process.wait()


TRAINING_METRICS = "metrics.json"
"""Headline metrics a training subprocess leaves in the work dir for the runner side."""
TRAINING_ERROR = "error.txt"
"""The subprocess's own one-line reason for failing (NaN at step N, vocabulary mismatch, ...)."""


def launch_training(
    inputs: BaseModel, launch: LaunchConfig, ctx: StageContext, module: str
) -> dict[str, Any]:
    """Run `module` as `accelerate launch ... -m module SPEC`, wait, and return its headline metrics.

    On a machine without a GPU (or with `launch.cpu`), ACCELERATE_USE_CPU=true turns a multi-process
    config into real gloo DDP ranks (`accelerate launch --cpu --num_processes 2` would silently run
    one process). The subprocess's output goes to the console and to `<work_dir>/<stage>.log`. A failed
    subprocess raises StageFailed with the reason it wrote (see `run_training_process`).
    """
    timeout, why = collective_timeout(launch, ctx.upstream)
    log.info("[%s] collective timeout %.0f s: %s", ctx.name, timeout, why)
    spec_path = spec_for(inputs, ctx, timeout).write(ctx.work_dir / "spec.json")
    config_file = resolve_accelerate_config(launch.accelerate_config)
    machines = ctx.leader.machines if ctx.leader is not None else None
    total = launch.num_processes
    if machines is not None:  # accelerate counts processes over all nodes: each node starts its share
        total = processes_per_node(config_file, launch.num_processes) * machines.nodes
    command = accelerate_command(config_file, total, module, [str(spec_path)], machines)
    error_file = ctx.work_dir / TRAINING_ERROR
    error_file.unlink(missing_ok=True)
    env = training_env(launch.cpu, launch.env, config_file, ctx.name)
    if ctx.leader is not None:  # the other nodes start the same launch with their machine rank
        ctx.leader.announce(
            {"kind": "launch", "stage": ctx.name, "module": module,
             "spec": spec_path.relative_to(ctx.run_dir).as_posix(), "config": launch.accelerate_config,
             "num_processes": total, "main_ip": machines.main_ip, "main_port": machines.main_port,
             "cpu": launch.cpu, "env": launch.env}
        )  # fmt: skip
    log.info("[%s] launching: %s", ctx.name, " ".join(command))
    log_path = ctx.work_dir / f"{ctx.name}.log"
    code = run_logged(command, env, log_path, ctx.quiet)
    if code != 0:
        if error_file.is_file():
            raise StageFailed(
                f"{ctx.name}: {error_file.read_text(encoding='utf-8').strip()} (log: {log_path})"
            )
        raise StageFailed(f"{ctx.name}: training exited with status {code}; see {log_path}")
    metrics = ctx.work_dir / TRAINING_METRICS
    if not metrics.is_file():
        raise StageFailed(f"{ctx.name}: training ended without writing {metrics.name}; see {log_path}")
    return json.loads(metrics.read_text(encoding="utf-8"))


def join_launch(event: dict[str, Any], run_dir: Path, machines: Machines, quiet: bool) -> None:
    """This node's part of a training launch node 0 announced (`pipelines/nodes.py`): the same accelerate
    config (resolved here), spec (in the shared run directory), process count and node 0 address, with
    this node's rank."""
    config_file = resolve_accelerate_config(event["config"])
    spec = str(run_dir / event["spec"])
    here = Machines(machines.nodes, machines.rank, event["main_ip"], event["main_port"])
    command = accelerate_command(config_file, event["num_processes"], event["module"], [spec], here)
    rank = machines.rank
    env = training_env(event["cpu"], event["env"], config_file, event["stage"])
    log_path = run_dir / "nodes" / f"node-{rank}-{event['stage']}.log"
    log.info("[%s] node %d launching: %s", event["stage"], rank, " ".join(command))
    code = run_logged(command, env, log_path, quiet)
    if code != 0:
        raise StageFailed(
            f"{event['stage']}: node {rank}'s training processes exited with status {code}; see {log_path}"
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
