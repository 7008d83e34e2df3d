"""Resumable training checkpoints under a stage's work dir: `<root>/checkpoints/step-00000042/`.

A checkpoint is what `accelerator.save_state` writes (model in safetensors, optimizer, and the RNG
states of every process: python, numpy, torch, CUDA), `<name>.pt` for each extra stateful object (the LR
scheduler), and `state.json`, the trainer's own position (step, data position, running totals). Extra
objects are saved here rather than registered with accelerate, so that one process can train several
models in turn (one drafter per language) with `accelerator.free_memory()` between them. It works the same under DDP, FSDP and DeepSpeed because accelerate saves
sharded states the way each backend needs.

Writes are atomic: everything goes into `step-N.partial/`, `state.json` is written last, and the folder
is renamed to `step-N/` only then. A run killed while saving leaves a `.partial` folder that is ignored
and replaced, so `list_checkpoints` only lists complete checkpoints. Only the last `keep` are kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from polydraft.models.folders import safetensors_problem

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
_NAME = re.compile(r"^step-(\d+)$")


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _NAME.match(path.name)) and (path / STATE_FILE).is_file()
    ]
    return [path for _, path in sorted(found)]


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


def save_checkpoint(
    accelerator: Any,
    root: Path,
    step: int,
    state: dict[str, Any],
    keep: int,
    stateful: dict[str, Any] | None = None,
) -> Path:
    """Save model, optimizer, RNG states, `stateful` objects (name -> object with `state_dict()`) and
    `state` as checkpoint `step`.

    Every process must call this (each saves its own RNG state; sharded backends save their shards).
    Returns the final folder. Older checkpoints beyond the last `keep` are deleted.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    final = root / f"step-{step:08d}"
    partial = root / f"step-{step:08d}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, obj in (stateful or {}).items():
            torch.save(obj.state_dict(), partial / f"{name}.pt")
        _write_json_atomic(partial / STATE_FILE, {"step": step, **state})
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why a complete-looking checkpoint cannot be loaded (a torn state.json, a truncated weights file
    left by a disk that filled up or a copy cut short), or None."""
    try:
        read_state(checkpoint)
    except (OSError, ValueError) as err:
        return f"{checkpoint / STATE_FILE}: unreadable ({err})"
    for file in sorted(checkpoint.rglob("*.safetensors")):
        problem = safetensors_problem(file)
        if problem:
            return problem
    return None


def resume_checkpoint(
    accelerator: Any, root: Path, stateful: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint under `root` that loads; one that does not is named in a warning and
    the previous one is tried. Returns (checkpoint, state), or None when there is none. Raises ValueError
    when checkpoints exist but none loads."""
    checkpoints = list_checkpoints(root)
    for checkpoint in reversed(checkpoints):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            try:
                return checkpoint, load_checkpoint(accelerator, checkpoint, stateful)
            except Exception as err:  # a truncated optimizer or RNG file fails inside torch.load
                problem = f"{checkpoint}: cannot be loaded ({type(err).__name__}: {err})"
        log.warning(
            "checkpoint %s is damaged (%s); falling back to the previous one", checkpoint.name, problem
        )
    if checkpoints:
        raise ValueError(
            f"no checkpoint under {root} can be loaded (see the warnings); delete {root} to start over"
        )
    return None


def load_checkpoint(
    accelerator: Any, checkpoint: Path, stateful: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Restore everything `save_checkpoint` saved (after `accelerator.prepare`); returns its `state`."""
    accelerator.load_state(str(checkpoint))
    for name, obj in (stateful or {}).items():
        obj.load_state_dict(torch.load(checkpoint / f"{name}.pt", weights_only=False))
    return read_state(checkpoint)
