"""Checks of a run's environment before any stage starts: the run directory and every local model folder
the recipe names. Each failure is an InputError (exit 2) naming the recipe key or option to change."""

from __future__ import annotations

import os
from pathlib import Path

from polydraft.models.folders import ModelFolderError, check_model_folder, is_local
from polydraft.pipelines.schema import Recipe, ResolvedTarget


class InputError(ValueError):
    """A bad input found before work starts: the message names the key or option and what to do."""


def check_run_dir(run_dir: Path) -> None:
    """The run directory is a writable directory, or can be created as one (nothing is created here)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"--run-dir {run_dir}: a file, not a directory; give a directory")
    existing = run_dir.absolute()
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(existing))
        probe = existing / f".polydraft-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise InputError(
            f"--run-dir {run_dir}: cannot write there ({err.strerror}: {existing}); give a writable directory"
        ) from err


def model_folders(recipe: Recipe, target: ResolvedTarget) -> list[tuple[str, str]]:
    """(recipe key, path) of every local model folder the enabled stages load."""
    folders = [("target.path", target.path)]
    if recipe.pretrain.enabled and recipe.pretrain.drafter.init:
        folders.append(("pretrain.drafter.init", recipe.pretrain.drafter.init))
    if recipe.finetune.enabled and not recipe.pretrain.enabled and recipe.finetune.drafter.init:
        folders.append(("finetune.drafter.init", recipe.finetune.drafter.init))
    if recipe.measure.enabled:
        folders += [(f"measure.extra_drafters.{n}", p) for n, p in recipe.measure.extra_drafters.items()]
    return [(key, path) for key, path in folders if is_local(path)]


def check_model_folders(recipe: Recipe, target: ResolvedTarget) -> None:
    for key, path in model_folders(recipe, target):
        try:
            check_model_folder(path)
        except ModelFolderError as err:
            raise InputError(f"{key}: {err}") from err
