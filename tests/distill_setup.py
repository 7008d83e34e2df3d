"""Tiny distill recipes, local translation files and a runner-like call of the distill stage."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from polydraft.pipelines.runtime.contract import StageContext, StageResult
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.schema import Recipe, ResolvedTarget, TrackingConfig
from polydraft.pipelines.schema.inputs import DistillInputs

PROJECT_ROOT = Path(__file__).resolve().parent.parent
GERMAN = [
    "Guten Morgen",
    "Das Haus ist alt",
    "Ich trinke Kaffee",
    "Der Zug ist spät",
    "Wo ist der Bahnhof",
    "Heute regnet es",
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def translation_file(tmp_path: Path, n: int = 4) -> Path:
    rows = [{"de": GERMAN[i % len(GERMAN)] + f" {i}", "en": f"english {i}"} for i in range(n)]
    return write_jsonl(tmp_path / "data" / "de_en.jsonl", rows)


def make_recipe(target_dir: Path, sources: list[dict], **distill: Any) -> Recipe:
    defaults = {"temperatures": [0.0, 1.0], "samples_per_prompt": 2, "max_new_tokens": 6, "batch_size": 4}
    return Recipe.model_validate(
        {
            "target": {"path": str(target_dir)},
            "data": {"pairs": ["de-en"], "distill": sources, **distill.pop("data", {})},
            "distill": {**defaults, **distill},
        }
    )


def run_distill(recipe: Recipe, target_dir: Path, work_dir: Path, quiet: bool = True) -> StageResult:
    """The distill stage of `recipe` on `target_dir`, working in `work_dir`, as the runner runs it."""
    from polydraft.pipelines.stages.distill import run

    context = StageContext(
        name="distill",
        run_dir=work_dir.parent,
        work_dir=work_dir,
        upstream={},
        tracker=Tracker(None, "distill"),
        tracking=TrackingConfig(mode="disabled"),
        quiet=quiet,
    )
    target = ResolvedTarget(path=str(target_dir), revision=None, dtype="auto", trust_remote_code=False)
    return run(DistillInputs.of(recipe, target), context)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a test server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_source(path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "local",
        "path": str(path),
        "pair": "de-en",
        "fields": {"source": "de", "target": "en"},
        **extra,
    }


def run_stage_from_json(spec_path: str) -> None:
    """Entry point of the subprocess the kill test starts (and kills)."""
    spec = json.loads(Path(spec_path).read_text())
    recipe = Recipe.model_validate(spec["recipe"])
    run_distill(recipe, Path(spec["target"]), Path(spec["work"]))
