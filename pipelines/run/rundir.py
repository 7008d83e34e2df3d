"""Run directories that never overwrite each other: one per recipe file by default, claimed by the recipe
file that first ran in it, and folders a run no longer uses moved aside instead of deleted.

- `default_run_dir`: `runs/<the recipe's path under its recipes/ folder>` (`recipes/vicuna-7b/de.yaml` runs
  in `runs/vicuna-7b/de`, `recipes/gemma-7b-it/de.yaml` in `runs/gemma-7b-it/de`); a recipe outside any
  `recipes/` folder runs in `runs/<name>-<hash of its absolute path>`. Two recipe files never share one.
- `claim_run_dir`: `origin.json` names the recipe file (and the overrides of the latest run); another
  recipe file is refused there unless `--force`.
- `move_aside`: a stage folder or a `.partial` folder that a run would replace goes to `<run_dir>/aside/`,
  with a message that says where; only `--force` deletes.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import shlex
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ORIGIN_FILE = "origin.json"
ASIDE_DIR = "aside"
RUNS = Path("runs")


class RunDirTaken(ValueError):
    """A run directory that another recipe file made."""


def default_run_dir(recipe: Path) -> Path:
    """The run directory of a recipe file when `--run-dir` is not given: unique per recipe file."""
    path = Path(recipe).resolve()
    for parent in path.parents:
        if parent.name == "recipes":
            return RUNS / path.relative_to(parent).with_suffix("")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    return RUNS / f"{path.stem}-{digest}"


def read_origin(run_dir: Path) -> dict[str, Any] | None:
    """What `claim_run_dir` recorded, or None (a new directory, or one made before origins were kept)."""
    try:
        origin = json.loads((run_dir / ORIGIN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return origin if isinstance(origin, dict) and isinstance(origin.get("recipe"), str) else None


def _legacy_recipe(run_dir: Path) -> str | None:
    """The recipe file named by the command in `run.json` of a run directory made without `origin.json`."""
    try:
        command = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))["command"]
        words = shlex.split(command.split("  #")[0])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if "run" not in words:
        return None
    after = words[words.index("run") + 1 :]
    recipe = next((w for w in after if w.endswith((".yaml", ".yml")) and "=" not in w), None)
    return str(Path(recipe).resolve()) if recipe else None


def claim_run_dir(run_dir: Path, recipe: Path, overrides: list[str], command: str, force: bool) -> None:
    """Record that `recipe` runs in `run_dir`; RunDirTaken when another recipe file made it (unless
    `force`). The same recipe file with other overrides is the same run, changed."""
    recipe_file = str(Path(recipe).resolve())
    origin = read_origin(run_dir)
    made_by = origin["recipe"] if origin else _legacy_recipe(run_dir)
    if made_by is not None and made_by != recipe_file and not force:
        raise RunDirTaken(
            f"{run_dir} holds the run of {made_by}, not of {recipe_file}: running this recipe there would "
            "replace that run's stages. Give this recipe its own --run-dir (or leave --run-dir out: each "
            "recipe file has its own default), or pass --force to run it there anyway"
        )
    if made_by is not None and made_by != recipe_file:
        log.warning("%s held the run of %s; --force: it is now the run of %s", run_dir, made_by, recipe_file)
    run_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    record = {
        "recipe": recipe_file,
        "overrides": list(overrides),
        "command": command,
        "created_at": origin["created_at"] if origin and made_by == recipe_file else now,
        "last_run_at": now,
    }
    tmp = run_dir / (ORIGIN_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(run_dir / ORIGIN_FILE)


def move_aside(folder: Path, run_dir: Path, why: str) -> Path:
    """Move `folder` into `<run_dir>/aside/` under a name that says when, and say so; returns where."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    aside = run_dir / ASIDE_DIR
    aside.mkdir(parents=True, exist_ok=True)
    destination = aside / f"{folder.name}-{stamp}"
    suffix = 1
    while destination.exists():
        suffix += 1
        destination = aside / f"{folder.name}-{stamp}-{suffix}"
    folder.rename(destination)
    log.warning("%s %s; moved it to %s (delete it when you no longer need it)", folder, why, destination)
    return destination
