"""Stand-in stages for runner tests: the real stage graph, each stage writing a small output and recording that it ran."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from polydraft.pipelines.run.recipe import load_recipe
from polydraft.pipelines.run.runner import StageOutcome, reuse_outputs, run_pipeline
from polydraft.pipelines.runtime.contract import Stage, StageFailed, StageResult
from polydraft.pipelines.schema import ResolvedTarget
from polydraft.pipelines.stages import default_stages


def _make(name: str):
    def run(inputs, ctx):
        log = Path(os.environ["FAKE_STAGE_LOG"])
        with open(log, "a") as handle:
            handle.write(name + "\n")
        inputs = {u: (p / "out.json").read_text() for u, p in sorted(ctx.upstream.items())}
        (ctx.work_dir / "part-1.txt").write_text("first half")
        if os.environ.get("FAKE_STAGE_HANG") == name and not (ctx.work_dir / "part-2.txt").exists():
            (ctx.work_dir / "hanging").write_text("")
            time.sleep(600)  # the test kills us here
        (ctx.work_dir / "part-2.txt").write_text("second half")
        resumed = (ctx.work_dir / "hanging").exists()
        (ctx.work_dir / "out.json").write_text(json.dumps({"stage": name, "inputs": sorted(inputs)}))
        if os.environ.get("FAKE_STAGE_FAIL") == name:
            raise StageFailed(f"{name} failed on purpose")
        return StageResult(metrics={"resumed": resumed, "value": 1.5})

    return run


def fake_stages() -> list[Stage]:
    """The real pipeline's stages (names, inputs, upstream edges) with stand-in functions."""
    return [dataclasses.replace(s, run=_make(s.name)) for s in default_stages()]


TOPOLOGY = [s.name for s in fake_stages()]


TARGET = ResolvedTarget(path="org/target", revision=None, dtype="auto", trust_remote_code=False)


def run(recipe_path: Path, run_dir: Path, *overrides: str, **kwargs) -> list[StageOutcome]:
    """The recipe at `recipe_path` with `overrides`, through the real runner and the stand-in stages."""
    recipe = load_recipe(recipe_path, list(overrides))
    return run_pipeline(recipe, run_dir, fake_stages(), TARGET, command="test", **kwargs)


def reuse(recipe_path: Path, run_dir: Path, donors: list[Path], *overrides: str) -> list[str]:
    """The stages `reuse_outputs` copies into `run_dir` from `donors` for the recipe with `overrides`."""
    recipe = load_recipe(recipe_path, list(overrides))
    return [name for name, _ in reuse_outputs(recipe, run_dir, fake_stages(), TARGET, donors)]
