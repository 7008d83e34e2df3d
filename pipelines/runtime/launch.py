"""Launching a stage's training processes with `accelerate launch` (`launch_training`, node 0) and joining a
launch node 0 announced (`join_launch`, the other nodes), with the command, environment and collective
timeout they share."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from polydraft.pipelines.runtime.contract import (
    PROJECT_ROOT,
    TRAINING_ERROR,
    TRAINING_METRICS,
    StageContext,
    StageFailed,
    spec_for,
)
from polydraft.pipelines.runtime.nodes import Machines, processes_per_node, usable_cores
from polydraft.pipelines.schema import (
    LaunchConfig,
)
from polydraft.pipelines.schema.common import AccelerateFile

log = logging.getLogger(__name__)


def collective_timeout(launch: LaunchConfig, upstream: dict[str, Path]) -> tuple[float, str]:
    """(seconds, why) of the training processes' collective timeout: `launch.collective_timeout_s`, else the
    longer of 30 minutes and 3 times rank 0's estimated time alone tokenizing the mix (`distill/mix/`)."""
    from polydraft.pipelines.runtime.cluster import COLLECTIVE_TIMEOUT_S, TOKENIZE_BYTES_PER_S

    if launch.collective_timeout_s is not None:
        return float(launch.collective_timeout_s), "launch.collective_timeout_s"
    mix = Path(upstream["distill"]) / "mix" if "distill" in upstream else None
    size = sum(p.stat().st_size for p in mix.glob("*/*.jsonl")) if mix is not None and mix.is_dir() else 0
    alone = size / TOKENIZE_BYTES_PER_S
    why = f"rank 0 alone tokenizes the {size / 1e6:.1f} MB mix in ~{alone:.0f} s"
    if 3 * alone > COLLECTIVE_TIMEOUT_S:
        return 3 * alone, f"3 times the longest step rank 0 takes alone: {why}"
    return COLLECTIVE_TIMEOUT_S, f"at least 30 minutes ({why})"


def resolve_accelerate_config(path: str) -> Path:
    """A config path as given, else relative to the project (`recipes/accelerate/...`)."""
    for candidate in (Path(path), PROJECT_ROOT / path):
        if candidate.is_file():
            return candidate.resolve()
    raise StageFailed(f"launch.accelerate_config: no such file {path!r} (see recipes/accelerate/)")


def distributed_type(config_file: Path) -> str:
    """An accelerate config's `distributed_type` (`NO` when it names none)."""
    return AccelerateFile.read(config_file).distributed_type


def cpu_fallback(config_file: Path) -> str | None:
    """Why a GPU-only accelerate config does not do what it says on a CPU machine, or None.

    With ACCELERATE_USE_CPU, accelerate runs an FSDP or DeepSpeed config's processes as plain gloo DDP
    (checked with accelerate 1.15: `distributed_type` MULTI_CPU, the model wrapped in
    DistributedDataParallel), so nothing is sharded.
    """
    kind = distributed_type(config_file)
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
    cores: int | None = None,
) -> list[str]:
    """`accelerate launch` of `module`: `num_processes` over all nodes (None: the config's); on several
    nodes, this node's rank among them and node 0's address (else the config's). Each process gets its
    share of `cores` (None: this node's; `--num_cpu_threads_per_process`: accelerate would set
    OMP_NUM_THREADS=1, which on a CPU machine left every training step on one core), unless
    OMP_NUM_THREADS is set."""
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
        threads = max(1, (cores or usable_cores()) // max(1, per_node))
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
    # the Popen context closes the pipe once the process is done (no ResourceWarning for an open pipe)
    with (
        open(log_path, "ab") as log_file,
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process,
    ):
        assert process.stdout is not None
        for line in process.stdout:
            log_file.write(line)
            log_file.flush()
            if not quiet:
                sys.stderr.buffer.write(line)
                sys.stderr.flush()
        return process.wait()


def launch_training(
    inputs: BaseModel, launch: LaunchConfig, ctx: StageContext, module: str
) -> dict[str, Any]:
    """Run `module` as `accelerate launch ... -m module SPEC`, wait, and return its headline metrics.

    On a machine without a GPU (or with `launch.cpu`), ACCELERATE_USE_CPU=true turns a multi-process
    config into real gloo DDP ranks (`accelerate launch --cpu --num_processes 2` would silently run
    one process). The subprocess's output goes to the console and to `<work_dir>/<stage>.log`. A failed
    subprocess raises StageFailed with the reason it wrote (see `run_training_process`). With
    `ctx.in_process`, a one-process launch runs in this process instead (`run_in_process`).
    """
    from polydraft.train.runtime import CORES_FILE_ENV

    timeout, why = collective_timeout(launch, ctx.upstream)
    log.info("[%s] collective timeout %.0f s: %s", ctx.name, timeout, why)
    spec_path = spec_for(inputs, ctx, timeout).write(ctx.work_dir / "spec.json")
    config_file = resolve_accelerate_config(launch.accelerate_config)
    machines = ctx.leader.machines if ctx.leader is not None else None
    error_file = ctx.work_dir / TRAINING_ERROR
    error_file.unlink(missing_ok=True)
    env = training_env(launch.cpu, launch.env, config_file, ctx.name)
    if ctx.cores_file is not None and "OMP_NUM_THREADS" not in os.environ:  # a user's thread count stays
        env[CORES_FILE_ENV] = str(ctx.cores_file)
    log_path = ctx.work_dir / f"{ctx.name}.log"
    if ctx.in_process:
        refuse_in_process(config_file, launch.num_processes, machines)
        log.info("[%s] training in this process (--in-process): %s", ctx.name, module)
        code = run_in_process(module, spec_path, env)
    else:
        total = launch.num_processes
        if machines is not None:  # accelerate counts processes over all nodes: each node starts its share
            total = processes_per_node(config_file, launch.num_processes) * machines.nodes
        command = accelerate_command(config_file, total, module, [str(spec_path)], machines, ctx.cpu_cores)
        if ctx.leader is not None:  # the other nodes start the same launch with their machine rank
            ctx.leader.announce(
                {"kind": "launch", "stage": ctx.name, "module": module,
                 "spec": spec_path.relative_to(ctx.run_dir).as_posix(), "config": launch.accelerate_config,
                 "num_processes": total, "main_ip": machines.main_ip, "main_port": machines.main_port,
                 "cpu": launch.cpu, "env": launch.env}
            )  # fmt: skip
        log.info("[%s] launching: %s", ctx.name, " ".join(command))
        code = run_logged(command, env, log_path, ctx.quiet)
    where = "its log is this process's" if ctx.in_process else f"log: {log_path}"
    if code != 0:
        if error_file.is_file():
            raise StageFailed(f"{ctx.name}: {error_file.read_text(encoding='utf-8').strip()} ({where})")
        raise StageFailed(f"{ctx.name}: training exited with status {code} ({where})")
    metrics = ctx.work_dir / TRAINING_METRICS
    if not metrics.is_file():
        raise StageFailed(f"{ctx.name}: training ended without writing {metrics.name} ({where})")
    return json.loads(metrics.read_text(encoding="utf-8"))


def refuse_in_process(config_file: Path, num_processes: int | None, machines: Machines | None) -> None:
    """StageFailed unless the launch is one plain process on one node (a DDP config at one process is
    one): `run_in_process` starts no process group, DeepSpeed or FSDP (those need `accelerate launch`)."""
    kind = distributed_type(config_file)
    processes = processes_per_node(config_file, num_processes)
    if machines is not None or processes != 1 or kind not in ("NO", "MULTI_CPU", "MULTI_GPU"):
        raise StageFailed(
            f"--in-process trains in the runner's own process, so only one plain process on one node; this "
            f"launch asks for {processes} process(es) a node on {machines.nodes if machines else 1} node(s) "
            f"with distributed_type {kind} ({config_file.name}): run without --in-process"
        )


def run_in_process(module: str, spec_path: Path, env: dict[str, str]) -> int:
    """Run the stage module's `main([SPEC])` in this process, `env` as the environment meanwhile, as
    `accelerate launch` would in a subprocess; returns 0, or 1 when it raised (its reason is in the error
    file it left, as a subprocess leaves it). No subprocess start: `polydraft study --quick`'s 43 tiny
    stages took 380 s through `accelerate launch` on 2 CPU cores and 80 s so. The training's log lines go to
    this process's log, and accelerate's process state is reset afterwards for the next stage's Accelerator."""
    import importlib

    from accelerate.state import AcceleratorState, GradientState

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        importlib.import_module(module).main([str(spec_path)])
        return 0
    except Exception as err:
        log.debug("in-process training of %s failed", module, exc_info=True)
        error = spec_path.parent / TRAINING_ERROR  # a failure before the job: no reason written yet
        if not error.is_file():
            error.write_text(f"{type(err).__name__}: {err}\n", encoding="utf-8")
        return 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
        # accelerate keeps one process state per process; its own tests reset it between Accelerators
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def join_launch(event: dict[str, Any], run_dir: Path, machines: Machines, quiet: bool) -> None:
    """This node's part of a training launch node 0 announced (`pipelines/runtime/nodes.py`): the same accelerate
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
