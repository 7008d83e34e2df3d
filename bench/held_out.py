"""What the bench scripts that decode the demo's held-out prompts share: the recipe's target, tokenizer and
eval sets loaded as the measure stage loads them, `mean ± std` cells, and the dated section each appends to
its record file (`--record`), and a module as another commit has it (`--against`)."""

from __future__ import annotations

import datetime
import importlib.util
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from polydraft.decoding.measurement.eval_inputs import EvalSet
from polydraft.decoding.measurement.groups import eos_ids_of, hardware
from polydraft.pipelines.schema import Recipe


@dataclass
class HeldOut:
    recipe: Recipe
    target: Any
    tokenizer: Any
    eos_ids: set[int]
    eval_sets: list[EvalSet]


def load_held_out(recipe_path: str | Path, overrides: list[str], count: int) -> HeldOut:
    """The recipe's target (eval mode, on the CPU) and the first `count` prompts of each eval set."""
    from transformers import AutoModelForCausalLM

    from polydraft.models.loading import load_tokenizer
    from polydraft.pipelines.run.recipe import load_recipe
    from polydraft.pipelines.runtime.target import resolve_target
    from polydraft.pipelines.schema.inputs import EvalPrompts

    recipe = load_recipe(Path(recipe_path), overrides)
    spec = resolve_target(recipe.target, recipe.data, show_progress=False)
    target = AutoModelForCausalLM.from_pretrained(spec.path).eval()
    tokenizer = load_tokenizer(spec.path, None, False)
    eval_sets = EvalPrompts.of(recipe).load(count, recipe.measure.max_prompt_tokens, tokenizer)
    return HeldOut(recipe, target, tokenizer, eos_ids_of(target, tokenizer), eval_sets)


def mean_std(values: list[float], digits: int = 2, sign: bool = False) -> str:
    """`mean ± std` (sample std), or `value (n=1)`."""
    form = f"{'+' if sign else ''}.{digits}f"
    if len(values) < 2:
        return f"{values[0]:{form}} (n=1)"
    return f"{statistics.mean(values):{form}} ± {statistics.stdev(values):.{digits}f}"


def record(script: str, setting: str, lines: list[str], path: Path | None) -> None:
    """Print the dated section (hardware, the command, `setting`, then `lines`) and append it to `path`."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    header = [
        f"## {date} — {hardware(torch.device('cpu'))}, {platform.machine()}, torch {torch.__version__}",
        "",
        "```",
        f"$ python -m bench.{script} " + " ".join(sys.argv[1:]),
        "```",
        "",
        setting,
        "",
    ]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write("\n" + text)


def module_at(commit: str, path: str, name: str, folder: Path) -> ModuleType:
    """`path` of the repository at `commit`, imported as module `name`."""
    source = subprocess.run(
        ["git", "show", f"{commit}:{path}"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        check=True,
    )
    file = folder / f"{name.rsplit('.', 1)[-1]}.py"
    file.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
