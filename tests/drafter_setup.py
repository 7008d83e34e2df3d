"""Tiny recipes, mixes and stage contexts for the drafter-trainer tests (no runner needed)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from distill.mix import mix_path, write_mix
from distill.offline import offline_pairs
from distill.prompts import task_prefix, vicuna_prompt
from pipelines.schema import Recipe
from pipelines.stage import ResolvedTarget, StageContext
from pipelines.tracking import Tracker

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
    """A recipe for a 1-layer hidden-32 drafter on the tiny target; `blocks` deep-merge over it."""
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
            "drafter": TINY_DRAFTER,
            "optim": {"lr": 3e-3},
            "loop": {**TINY_LOOP, "max_length": 160, "max_steps": 6},
        },
        "tracking": {"mode": "disabled"},
    }
    return Recipe.model_validate(_merge(data, blocks))


def write_tiny_mix(distill_dir: Path, pairs: list[str], train_rows: int = 24, eval_rows: int = 8) -> Path:
    """A mix as the distill stage writes it: Vicuna prompts, the offline references as greedy answers."""
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
            write_mix(rows, mix_path(distill_dir, pair, split))
    return distill_dir


def context(
    run_dir: Path, name: str, target_dir: Path, upstream: dict[str, Path] | None = None
) -> StageContext:
    work_dir = run_dir / f"{name}.partial"
    work_dir.mkdir(parents=True, exist_ok=True)
    return StageContext(
        name=name,
        run_dir=run_dir,
        work_dir=work_dir,
        upstream=upstream or {},
        target=ResolvedTarget(path=str(target_dir), revision=None, dtype="float32", trust_remote_code=False),
        tracker=Tracker(None, name),
        quiet=True,
    )
