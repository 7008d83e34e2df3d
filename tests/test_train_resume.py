"""A real launched run killed mid-way resumes with the same losses; a NaN loss stops the run cleanly."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from pipelines.stage import PROJECT_ROOT, StageFailed
from tests.drafter_setup import context, run_stage, tiny_recipe
from train.checkpoint import list_checkpoints, read_state
from train.steplog import read_log

STEPS = 300


def _start_in_background(recipe, ctx, target_dir) -> subprocess.Popen:
    """The pretrain stage in a process of its own session, so that the launcher and its worker die together."""
    code = (
        "import pickle, sys; from tests.drafter_setup import run_stage; "
        "run_stage('pretrain', *pickle.load(sys.stdin.buffer))"
    )
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    process.stdin.write(pickle.dumps((recipe, ctx, target_dir)))
    process.stdin.close()
    return process


def test_killed_pretraining_resumes_with_the_same_losses(tmp_path, tiny_target_dir):
    recipe = tiny_recipe(
        tiny_target_dir, pretrain={"loop": {"max_steps": STEPS, "checkpoint_every": 10, "log_every": 50}}
    )
    ctx = context(tmp_path, "pretrain")
    ctx.quiet = False  # keep the worker's log lines (the resume message) in pretrain.log
    log_path = ctx.work_dir / "model.train_log.jsonl"
    checkpoints = ctx.work_dir / "model.checkpoints"

    process = _start_in_background(recipe, ctx, tiny_target_dir)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and process.poll() is None:
            saved = list_checkpoints(checkpoints)
            if saved and len(read_log(log_path)) >= read_state(saved[-1])["step"] + 3:
                break
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and the training worker, mid-step
        process.wait()
    killed_log = read_log(log_path)
    resumed_from = read_state(list_checkpoints(checkpoints)[-1])["step"]
    assert not (ctx.work_dir / "model").exists(), "the run finished before it could be killed"
    assert resumed_from < len(killed_log) < STEPS

    result = run_stage("pretrain", recipe, ctx, tiny_target_dir)

    assert (
        f"resuming from {checkpoints / f'step-{resumed_from:08d}'}"
        in (ctx.work_dir / "pretrain.log").read_text()
    )
    final_log = read_log(log_path)
    assert [e["step"] for e in final_log] == list(range(1, STEPS + 1))
    redone = [e for e in killed_log if e["step"] > resumed_from]
    assert redone
    for before, after in zip(killed_log, final_log, strict=False):
        assert after["step"] == before["step"]
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)
        assert after["lr"] == pytest.approx(before["lr"], rel=1e-9)
        assert after["grad_norm"] == pytest.approx(before["grad_norm"], rel=1e-5, abs=1e-7)
        assert after["tokens"] == before["tokens"]
    assert result.metrics["drafter"]["steps"] == STEPS


def test_a_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, tiny_target_dir):
    # an absurd learning rate: step 1 is fine, its update overflows the weights, step 2's loss is NaN
    recipe = tiny_recipe(
        tiny_target_dir,
        pretrain={
            "optim": {"lr": 1e30, "max_grad_norm": 0.0, "weight_decay": 0.0},
            "loop": {"max_steps": 6, "checkpoint_every": 1},
        },
    )
    ctx = context(tmp_path, "pretrain")
    with pytest.raises(
        StageFailed, match=r"loss is nan at step 2; the last good checkpoint is kept at .*step-00000001"
    ):
        run_stage("pretrain", recipe, ctx, tiny_target_dir)
    kept = list_checkpoints(ctx.work_dir / "model.checkpoints")
    assert [p.name for p in kept] == ["step-00000001"]
    assert read_state(kept[0])["step"] == 1 and (kept[0] / "model.safetensors").is_file()
    assert not (ctx.work_dir / "model").exists() and not (ctx.work_dir / "metrics.json").exists()
