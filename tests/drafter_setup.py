"""Tiny recipes, mixes and stage contexts for the drafter-trainer tests (no runner needed)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from polydraft.data.mix import MixWriter
from polydraft.data.offline import offline_pairs
from polydraft.data.prompts import task_prefix, vicuna_prompt
from polydraft.pipelines.runtime.contract import StageContext, StageResult
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.schema import Recipe, ResolvedTarget, TrackingConfig

TINY_DRAFTER = {"arch": "custom", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
TINY_LOOP = {
    "max_length": 64,
    "per_device_batch_size": 4,
    "log_every": 1,
    "eval_every": 0,
    "checkpoint_every": 2,
    "keep_checkpoints": 2,
}


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def tiny_recipe(target_dir: Path, **blocks: Any) -> Recipe:
    """A recipe for a 1-layer hidden-32 drafter on the tiny target; `blocks` deep-merge over it (without
    pretraining, `finetune.drafter` starts as that tiny drafter)."""
    data = {
        "target": {"path": str(target_dir)},
        "data": {
            "pairs": ["de-en", "fr-en"],
            "pretrain": [{"kind": "offline", "format": "text", "limit": 120}],
            "offline": {"samples_per_pair": 120},
        },
        "pretrain": {
            "drafter": TINY_DRAFTER,
            "token_budget": 64 * 4 * 6,
            "optim": {"lr": 3e-3},
            "loop": TINY_LOOP,
        },
        "finetune": {
            "optim": {"lr": 3e-3},
            "loop": {**TINY_LOOP, "max_length": 160, "max_steps": 6},
        },
        "tracking": {"mode": "disabled"},
        # the real vLLM generation has tests of its own (test_export_smoke.py); ~15 s per drafter
        "export": {"vllm_check": "off"},
    }
    merged = _merge(data, blocks)
    if merged["pretrain"].get("enabled") is False:  # F only: finetune starts from its own drafter
        merged["finetune"]["drafter"] = _merge(TINY_DRAFTER, merged["finetune"].get("drafter", {}))
    return Recipe.model_validate(merged)


def write_tiny_mix(distill_dir: Path, pairs: list[str], train_rows: int = 24, eval_rows: int = 8) -> Path:
    """A mix as the distill stage writes it: Vicuna prompts, the offline references as greedy answers."""
    writer = MixWriter(distill_dir)
    for pair in pairs:
        for split, count in (("train", train_rows), ("eval", eval_rows)):
            source_split = "train" if split == "train" else "test"
            rows = [
                {
                    "id": f"{pair}/{split}/{i}",
                    "pair": pair,
                    "origin": "distill",
                    "prompt": vicuna_prompt(
                        [
                            {"role": "system", "content": "Chat."},  # short: tiny tokenizers split a lot
                            {"role": "user", "content": task_prefix(pair) + row["source"]},
                        ]
                    ),
                    "response": " " + row["target"],
                    "temperature": 0.0 if i % 2 == 0 else 1.0,
                    "sample_index": 0,
                }
                for i, row in enumerate(offline_pairs(pair, source_split, count, seed=1))
            ]
            for row in rows:
                writer.add(row, split)
    writer.close()
    return distill_dir


def target_of(target_dir: Path | str) -> ResolvedTarget:
    return ResolvedTarget(path=str(target_dir), revision=None, dtype="float32", trust_remote_code=False)


def context(
    run_dir: Path, name: str, upstream: dict[str, Path] | None = None, mode: str = "disabled"
) -> StageContext:
    """The context the runner gives stage `name` (work dir `<run_dir>/<name>.partial`)."""
    work_dir = run_dir / f"{name}.partial"
    work_dir.mkdir(parents=True, exist_ok=True)
    return StageContext(
        name=name,
        run_dir=run_dir,
        work_dir=work_dir,
        upstream=upstream or {},
        tracker=Tracker(None, name),
        tracking=TrackingConfig(mode=mode),
        quiet=True,
    )


def stage_inputs(name: str, recipe: Recipe, target_dir: Path | str) -> Any:
    """Stage `name`'s inputs object, built as the runner builds it."""
    from polydraft.pipelines.stages import default_stages

    stage = next(s for s in default_stages() if s.name == name)
    return stage.inputs(recipe, target_of(target_dir))


def run_stage(name: str, recipe: Recipe, ctx: StageContext, target_dir: Path | str) -> StageResult:
    """Run stage `name` of `recipe` as the runner would, in `ctx`."""
    from polydraft.pipelines.stages import default_stages

    stage = next(s for s in default_stages() if s.name == name)
    return stage.run(stage.inputs(recipe, target_of(target_dir)), ctx)
