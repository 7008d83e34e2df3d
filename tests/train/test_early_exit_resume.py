"""A real `accelerate launch` of the early-exit stage, SIGKILLed right after step 10 (2 steps past a checkpoint) and rerun, resumes: the
same later losses and the same final head, bit for bit, as a run never interrupted, and the steps before
the checkpoint are not trained again (tests/resume_check.py). Its losses also equal those of 2 DDP ranks
(gloo) against the one process accumulating 2 micro-batches: the same global batches, the same token-mean
loss."""

from __future__ import annotations

import pytest

from polydraft.train.early_exit import HEAD_DIR, LOG_FILE
from polydraft.train.steplog import read_log
from tests.drafter_setup import context, run_stage, tiny_recipe, write_tiny_mix
from tests.resume_check import assert_resumed, assert_same_weights, killed_then_resumed

LOOP = {"max_length": 96, "per_device_batch_size": 2, "grad_accum_steps": 2, "max_steps": 24, "log_every": 4, "eval_every": 0,
        "eval_batches": 1, "checkpoint_every": 4, "keep_checkpoints": 2}  # fmt: skip
HEAD = f"{HEAD_DIR}/early_exit.safetensors"


def test_killed_run_resumes_like_an_uninterrupted_run(tmp_path, tiny_target_dir):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=24, eval_rows=4)
    block = {"num_shared_layers": 2, "optim": {"lr": 1e-2}}
    recipe = tiny_recipe(tiny_target_dir, early_exit={**block, "loop": LOOP})
    whole = context(tmp_path / "whole", "early_exit", {"distill": distill})
    run_stage("early_exit", recipe, whole, tiny_target_dir)
    assert len(read_log(whole.work_dir / LOG_FILE)) == 24

    killed = context(tmp_path / "killed", "early_exit", {"distill": distill})
    work = killed.work_dir
    step, checkpoint = killed_then_resumed(
        "early_exit",
        recipe,
        killed,
        tiny_target_dir,
        10,
        work / "checkpoints",
        work / LOG_FILE,
        work / HEAD_DIR,
    )
    assert 0 < step < 24
    log_path = work / LOG_FILE
    assert_resumed(log_path, killed.work_dir / "early_exit.log", checkpoint, step, whole.work_dir / LOG_FILE)
    assert_same_weights(killed.work_dir / HEAD, whole.work_dir / HEAD)

    ddp = {"accelerate_config": "recipes/accelerate/ddp.yaml", "num_processes": 2}
    two_ranks = tiny_recipe(
        tiny_target_dir, early_exit={**block, "loop": {**LOOP, "grad_accum_steps": 1}}, launch=ddp
    )
    ranks = context(tmp_path / "ranks", "early_exit", {"distill": distill})
    run_stage("early_exit", two_ranks, ranks, tiny_target_dir)
    # up to float summation order
    expected = [e["loss"] for e in read_log(ranks.work_dir / LOG_FILE)]
    assert [e["loss"] for e in read_log(log_path)] == pytest.approx(expected, rel=1e-5)
