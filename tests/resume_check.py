"""Kill a real training run with SIGKILL at a chosen step after a checkpoint, resume it, and compare it with a run never
interrupted (the training resume tests).

A resumed run must be told apart from a restart, which deterministic training cannot do by its numbers
alone (a restart recomputes the same losses and weights). So, after the kill, `mark_before_kill` tags the
log entries of the steps the checkpoint covers; a resume keeps them (it truncates the log to its
checkpoint's step and trains only the later steps), a restart rewrites the log from step 1 and loses the
tags. The stage log must also name the checkpoint and step it resumed from.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from polydraft.pipelines.runtime.contract import PROJECT_ROOT, StageContext, spec_for
from polydraft.pipelines.runtime.launch import accelerate_command, resolve_accelerate_config
from polydraft.train.checkpoint import list_checkpoints, read_state
from polydraft.train.loop import KILL_ENV
from polydraft.train.steplog import read_log
from tests.drafter_setup import run_stage, stage_inputs

MARK = "before_kill"


def run_killed_at(
    command: list[str], env: dict[str, str], kill_after: int, checkpoints: Path, log_path: Path
) -> int:
    """Run `command` in its own session with the trainer told (`train.loop.KILL_ENV`) to SIGKILL its
    process group right after step `kill_after` is logged; returns the newest checkpoint's step, which
    must lie before `kill_after` (so logged steps are lost and redone)."""
    env = {**env, KILL_ENV: str(kill_after)}
    code = subprocess.run(
        command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        timeout=600,
    ).returncode  # fmt: skip
    assert code == -signal.SIGKILL, (
        f"the training process ended with status {code}, not killed at {kill_after}"
    )
    saved = list_checkpoints(checkpoints)
    assert saved, f"no checkpoint before step {kill_after}"
    step = read_state(saved[-1])["step"]
    assert len(read_log(log_path)) == kill_after > step, (
        "the kill came after a checkpoint of every logged step"
    )
    return step


def killed_then_resumed(
    name: str,
    recipe: Any,
    ctx: StageContext,
    target_dir: Path,
    kill_after: int,
    checkpoints: Path,
    log_path: Path,
    done: Path,
) -> tuple[int, Path]:
    """Launch stage `name`'s training process as the stage does, have it SIGKILLed right after step
    `kill_after` (checkpoints under `checkpoints`), mark the log, rerun the stage here; returns (checkpoint
    step, its folder). `done` is what only a finished run leaves behind."""
    inputs = stage_inputs(name, recipe, target_dir)
    spec = spec_for(inputs, ctx).write(ctx.work_dir / "spec.json")
    config = resolve_accelerate_config(recipe.launch.accelerate_config)
    command = accelerate_command(config, None, f"polydraft.pipelines.stages.{name}", [str(spec)])
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "ACCELERATE_USE_CPU": "true"}
    step = run_killed_at(command, env, kill_after, checkpoints, log_path)
    checkpoint = list_checkpoints(checkpoints)[-1]
    assert not done.exists(), "the run finished before it could be killed"
    mark_before_kill(log_path)
    ctx.quiet = False  # the worker's INFO lines (the resume message) go to <stage>.log
    run_stage(name, recipe, ctx, target_dir)
    return step, checkpoint


def mark_before_kill(log_path: Path) -> None:
    """Tag every entry the killed run logged."""
    entries = [{**e, MARK: True} for e in read_log(log_path)]
    log_path.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")


def assert_resumed(log_path: Path, stage_log: Path, checkpoint: Path, step: int, reference: Path) -> None:
    """The run resumed at `step` from `checkpoint` (log line; the killed run's entries up to `step` kept,
        the later ones redone) and logged the same steps and losses (and learning rates and gradient norms where
    logged), bit for bit, as the `reference` log."""
    text = stage_log.read_text(encoding="utf-8")
    assert f"resuming from {checkpoint} (step {step} of" in text, f"no resume from step {step} in {stage_log}"
    entries, expected = read_log(log_path), read_log(reference)
    assert [e["step"] for e in entries] == [e["step"] for e in expected]
    assert [bool(e.get(MARK)) for e in entries] == [e["step"] <= step for e in entries], "steps were redone"
    fields = [k for k in ("loss", "lr", "grad_norm") if k in expected[0]]
    for got, want in zip(entries, expected, strict=True):
        assert [got[k] for k in fields] == [want[k] for k in fields], got


def assert_same_weights(path: Path, reference: Path) -> None:
    """Two safetensors files hold the same tensors, bitwise."""
    got, want = load_file(path), load_file(reference)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{path}: {name} differs from the uninterrupted run"
