"""Stages side by side (`runner.parallel_stages`): a stage starts once its upstream stages are done, up to N
at once, each in a thread of its own.

On a CPU machine with a few cores, small models train faster in one-thread processes side by side than in
one process on every core (a batch-1 forward or a small training step leaves most of a second core idle):
the demo's eagle3 stage trains beside pretrain -> finetune -> early_exit -> calibrate, its chain of
drafter stages (bench/results/parallel_stages.md); when one side ends, the other gets its core. The runner
(`pipelines.run.runner`) plans, runs and records each stage; this module decides when each one starts and
how many of the cores each running one gets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from polydraft.pipelines.runtime.contract import Stage, StageResult
from polydraft.pipelines.runtime.nodes import NodeLeader
from polydraft.pipelines.schema import Recipe

log = logging.getLogger(__name__)

J = TypeVar("J")


def parallel_stages(recipe: Recipe, leader: NodeLeader | None, in_process: bool) -> int:
    """How many stages may run at once: `runner.parallel_stages`, but one with `--in-process` (accelerate's
    process state is one per process) or on several nodes (each launch is announced to the other nodes,
    which join one at a time)."""
    wanted = recipe.runner.parallel_stages
    if wanted > 1 and (in_process or leader is not None):
        why = (
            "--in-process trains in this process"
            if in_process
            else "the other nodes join one launch at a time"
        )
        log.info("runner.parallel_stages is %d, but stages run one at a time: %s", wanted, why)
        return 1
    return wanted


def run_side_by_side(
    enabled: list[Stage],
    enabled_names: set[str],
    parallel: int,
    plan: Callable[[Stage], J | None],
    execute: Callable[[J], StageResult],
    complete: Callable[[J, StageResult], None],
    share: Callable[[list[J]], None],
) -> None:
    """Start each stage, in pipeline order, once none of its upstream stages is waiting or running, up to
    `parallel` `side_by_side` stages at once (any other stage alone): `plan(stage)` (here) gives its job, or None for a stage that does not run;
    `execute(job)` runs it in a thread of its own; `complete(job, result)` (here) records it; `share(jobs)`
    (here), each time the stages that run change, hands the running jobs their shares of the cores: a
    stage left running alone gets those of the one that ended. After a failure no stage starts; those
    running finish and are kept, then the first failure is raised."""
    waiting = list(enabled)
    running: dict[Future[StageResult], tuple[Stage, J]] = {}  # each job with its stage
    failure: BaseException | None = None

    def next_ready() -> Stage | None:
        """The first waiting stage none of whose upstream stages waits or runs, that may start beside what
        runs: any one when nothing runs, else one `side_by_side` beside `side_by_side` ones."""
        if any(not stage.side_by_side for stage, _ in running.values()):
            return None
        busy = {s.name for s in waiting} | {stage.name for stage, _ in running.values()}
        for stage in waiting:
            ready = not any(u in busy for u in stage.upstream if u in enabled_names)
            if ready and (stage.side_by_side or not running):
                return stage
        return None

    with ThreadPoolExecutor(parallel, thread_name_prefix="stage") as pool:
        while True:
            stage = next_ready() if failure is None and len(running) < parallel else None
            if stage is not None:
                waiting.remove(stage)
                try:
                    job = plan(stage)
                except BaseException as err:
                    failure = err
                    continue
                if job is not None:
                    running[pool.submit(execute, job)] = (stage, job)
                continue
            if not running:
                break
            share([job for _, job in running.values()])
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            failed_now = []
            for future in done:
                stage, job = running.pop(future)
                try:
                    complete(job, future.result())
                except BaseException as err:
                    failure = failure or err
                    failed_now.append(stage.name)
            if failed_now and running:
                log.error(
                    "%s failed: no stage starts now; %s still running, kept once done",
                    " and ".join(failed_now),
                    ", ".join(stage.name for stage, _ in running.values()),
                )
    if failure is not None:
        raise failure
