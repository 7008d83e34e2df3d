"""A real `accelerate launch` of the early-exit stage, SIGKILLed after a checkpoint and rerun, continues
with the losses of a run that was never interrupted, here one of 2 DDP ranks (gloo) against one
process accumulating 2 micro-batches: the same global batches, the same token-mean loss."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from pipelines.stage import PROJECT_ROOT, accelerate_command, resolve_accelerate_config, spec_for
from tests.drafter_setup import context, run_stage, stage_inputs, tiny_recipe, write_tiny_mix
from train.early_exit import HEAD_DIR, LOG_FILE

LOOP = {"max_length": 96, "per_device_batch_size": 2, "grad_accum_steps": 2, "max_steps": 24, "log_every": 4, "eval_every": 0,
        "eval_batches": 1, "checkpoint_every": 4, "keep_checkpoints": 2}  # fmt: skip


def losses(work_dir):
    return [json.loads(line)["loss"] for line in (work_dir / LOG_FILE).read_text().splitlines()]


def test_killed_run_resumes_with_the_same_losses(tmp_path, tiny_target_dir):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=24, eval_rows=4)
    recipe = tiny_recipe(
        tiny_target_dir, early_exit={"num_shared_layers": 2, "optim": {"lr": 1e-2}, "loop": LOOP}
    )

    ddp = {"accelerate_config": "recipes/accelerate/ddp.yaml", "num_processes": 2}
    two_ranks = tiny_recipe(
        tiny_target_dir,
        early_exit={"num_shared_layers": 2, "optim": {"lr": 1e-2}, "loop": {**LOOP, "grad_accum_steps": 1}},
        launch=ddp,
    )
    whole = context(tmp_path / "whole", "early_exit", {"distill": distill})
    run_stage("early_exit", two_ranks, whole, tiny_target_dir)
    expected = losses(whole.work_dir)
    assert len(expected) == 24

    killed = context(tmp_path / "killed", "early_exit", {"distill": distill})
    spec = spec_for(stage_inputs("early_exit", recipe, tiny_target_dir), killed).write(
        killed.work_dir / "spec.json"
    )
    command = accelerate_command(
        resolve_accelerate_config(recipe.launch.accelerate_config),
        None,
        "pipelines.stages.early_exit",
        [str(spec)],
    )
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "ACCELERATE_USE_CPU": "true"}
    process = subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    first = killed.work_dir / "checkpoints" / "step-00000004" / "state.json"
    deadline = time.monotonic() + 300
    while not first.is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert first.is_file(), "the run never reached its first checkpoint"
    assert not (killed.work_dir / HEAD_DIR).exists(), "the run finished before it was killed"
    assert len(losses(killed.work_dir)) < 24

    run_stage("early_exit", recipe, killed, tiny_target_dir)
    # same data order, RNG and optimizer state: the same numbers (up to float summation order)
    assert losses(killed.work_dir) == pytest.approx(expected, rel=1e-5)
    assert (killed.work_dir / HEAD_DIR / "early_exit.safetensors").is_file()
