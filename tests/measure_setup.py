"""A tiny measure recipe, two drafters for it and a runner-like call of the measure stage (shared by the
measure tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polydraft.models.tiny import build_llama
from polydraft.pipelines.runtime.contract import StageContext, StageResult
from polydraft.pipelines.schema import DataConfig, MeasureConfig, Recipe, SourceConfig, TargetConfig
from tests.drafter_setup import context, run_stage

PAIRS = ["de-en", "fr-en"]


def measure_recipe(target_dir, **measure) -> Recipe:
    settings = {
        "num_prompts": 2,
        "max_new_tokens": 6,
        "temperatures": [0.0, 1.0],
        "seeds": [0, 1],
        "decoders": ["ar", "sd", "rsd_c", "rsd_s", "assisted"],
        "controls": ["fixed", "beta_ts"],
        "k_sweep": [2],
        "draft_length": 3,
        "branching": [2, 1],
        "beam_width": 2,
        "beam_depth": 2,
        **measure,
    }
    return Recipe(
        target=TargetConfig(path=str(target_dir)),
        data=DataConfig(
            pairs=PAIRS, eval=[SourceConfig(kind="offline", split="test", pair=pair) for pair in PAIRS]
        ),
        measure=MeasureConfig(**settings),
    )


def measure_context(run_dir: Path, upstream: dict[str, Path]) -> StageContext:
    return context(run_dir, "measure", upstream)


def run_measure(recipe: Recipe, ctx: StageContext, target_dir: Path) -> StageResult:
    return run_stage("measure", recipe, ctx, target_dir)


def write_drafters(folder: Path, tokenizer: Any, target: Any) -> Path:
    """Two 'finetuned' drafters in `folder`, one per pair of PAIRS: the target's first (second) layer plus
    its head, so they agree with it sometimes; returns `folder`."""
    for index, pair in enumerate(PAIRS):
        drafter = build_llama(len(tokenizer), 64, 1, 4, 128, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              seed=index)  # fmt: skip
        state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.")}
        state.update({k: v for k, v in target.state_dict().items() if k.startswith(f"model.layers.{index}.")})
        drafter.load_state_dict({k.replace(f"layers.{index}.", "layers.0."): v for k, v in state.items()})
        drafter.save_pretrained(folder / pair)
        tokenizer.save_pretrained(folder / pair)
    return folder
