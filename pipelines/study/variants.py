"""The study's variants: each the recipe plus command-line overrides, run in its own run directory.

Every variant turns off what it does not measure (export always; the early-exit, heads and calibration
stages where no finding reads them) so that only the stages its findings need run, and sets the measure
block its findings compare. Variants whose stages have the same inputs share them: the runner's keys
decide (`pipelines.runner.reuse_outputs`), so the distillation runs once, the pretrained drafter once,
and the recipe's own finetune once for the variants that measure it differently.

Settings come from the seeds, not from the results: the tree shapes of seed 002's draft length 3, the
fixed K sweep of seed 001 Fig. 3, seed 003's two measurement temperatures (0 and 1), seed 002's WMT
temperature 0.3 for the trees, and finetune budgets that halve the recipe's three times.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from polydraft.pipelines.schema import Recipe
from polydraft.pipelines.study.model import (
    BUDGETS,
    DISTILL_T0,
    EESD,
    EESD_NO_LAYER,
    F_ONLY,
    HEADS,
    K_SWEEP,
    PF,
    TREE_DEPTH,
    TREES,
    budget_variant,
)

COMPARE_TEMPERATURES = [0.0, 1.0]
"""Seed 003 Table 1 measures at T=0 and T=1."""
TREE_TEMPERATURES = [0.0, 0.3]
"""Seed 002 measures WMT at T=0.3; T=0 adds the trees to the lossless check."""
MIN_SEEDS = 3


@dataclass(frozen=True)
class Variant:
    name: str
    purpose: str
    overrides: tuple[str, ...]
    skip: str | None = None
    """Why this recipe cannot run the variant (its findings are then `not run` with this reason)."""


def flow(value: Any) -> str:
    """A value as one line of YAML, for a `key=value` override."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()


def _measure(**fields: Any) -> str:
    defaults = {"controls": ["fixed"], "k_sweep": [], "include_pretrained": False, "cross_pairs": False}
    return "measure=" + flow(defaults | fields)


def _finetune_fraction(recipe: Recipe, fraction: float) -> str:
    """The recipe's finetune length times `fraction` (its steps when it sets max_steps, else its epochs)."""
    loop = recipe.finetune.loop
    if loop.max_steps is not None:
        return f"finetune.loop.max_steps={max(1, round(loop.max_steps * fraction))}"
    assert loop.epochs is not None, "the recipe loader fills finetune.loop.epochs"
    return f"finetune.loop.epochs={loop.epochs * fraction:g}"


def variants(recipe: Recipe) -> list[Variant]:
    """The variants of `recipe`, in the order they run (each reuses what the earlier ones made)."""
    no_export = "export.enabled=false"
    drafters_only = ("early_exit.enabled=false", "heads.enabled=false", "calibrate.enabled=false", no_export)
    chain = {"decoders": ["ar", "sd"]}
    compare = _measure(**chain, temperatures=COMPARE_TEMPERATURES)
    pf = Variant(
        PF,
        "the recipe's pretrain-then-finetune drafters (P-F) and the pretrained generic drafter (P), fixed K "
        "and Beta-TS, on every pair's eval set",
        (
            *drafters_only,
            _measure(
                **chain, controls=["fixed", "beta_ts"], temperatures=COMPARE_TEMPERATURES,
                include_pretrained=True, cross_pairs=True,
            ),
        ),
    )  # fmt: skip
    drafter = flow(recipe.pretrain.drafter.model_dump(mode="json"))
    f_only = Variant(
        F_ONLY,
        "finetune only (F): the same drafter shape trained from random weights on the same mix",
        (*drafters_only, "pretrain.enabled=false", f"finetune.drafter={drafter}", pf.overrides[-1]),
    )
    budgets = [
        Variant(
            budget_variant(fraction),
            f"the P-F drafters finetuned for {fraction:g} of the recipe's finetune length",
            (*drafters_only, _finetune_fraction(recipe, fraction), _measure(**chain, temperatures=[0.0])),
        )
        for fraction in BUDGETS
    ]
    skip_t0 = None
    if 0.0 not in recipe.distill.temperatures or len(recipe.distill.temperatures) < 2:
        skip_t0 = f"distill.temperatures is {recipe.distill.temperatures}: no T=0-only subset to compare"
    distill_t0 = Variant(
        DISTILL_T0,
        "P-F drafters finetuned on the T=0 distillation only (`finetune.temperatures=[0.0]`)",
        (*drafters_only, "finetune.temperatures=[0.0]", compare),
        skip_t0,
    )
    tree = Variant(
        TREES,
        f"SD K={TREE_DEPTH}, RSD-C 2-2-2 and RSD-S 3x3 (seed 002's draft length {TREE_DEPTH})",
        (
            *drafters_only,
            _measure(
                decoders=["ar", "sd", "rsd_c", "rsd_s"], draft_length=TREE_DEPTH,
                branching=[2] * TREE_DEPTH, beam_width=3, beam_depth=TREE_DEPTH,
                temperatures=TREE_TEMPERATURES,
            ),
        ),
    )  # fmt: skip
    heads = Variant(
        HEADS,
        "the recipe's heads block (Medusa or BPD heads), alone and rescored by each pair's P-F drafter",
        (
            "early_exit.enabled=false", "calibrate.enabled=false", "heads.enabled=true", no_export,
            _measure(decoders=["ar", "bpd", "medusa", "bpd+rescore", "medusa+rescore"], temperatures=[0.0]),
        ),
    )  # fmt: skip
    k = recipe.measure.draft_length
    self_speculative = (
        "pretrain.enabled=false", "finetune.enabled=false", "heads.enabled=false", "early_exit.enabled=true",
        "calibrate.enabled=true", "calibrate.drafters=early_exit", no_export,
        _measure(
            decoders=["ar", "eesd"], controls=["fixed", "beta_ts", "cali_ts"],
            k_sweep=[s for s in K_SWEEP if s != k], temperatures=[0.0],
        ),
    )  # fmt: skip
    eesd = Variant(
        EESD,
        f"EESD with one exit layer: fixed K in {list(K_SWEEP)}, Beta-TS, Cali-TS",
        (*self_speculative, "early_exit.num_exit_layers=1"),
    )
    no_layer = Variant(
        EESD_NO_LAYER,
        "EESD without the exit layer (norm and head only), measured as `eesd`",
        (*self_speculative, "early_exit.num_exit_layers=0"),
    )
    return [pf, tree, heads, *budgets, distill_t0, f_only, eesd, no_layer]


def quick_overrides(study_dir: Path) -> list[str]:
    """`--quick`: tiny models and data for a demo-shaped recipe (a bootstrap target, offline data), so that
    the whole study runs in the test suite. Its numbers say nothing; its report has every part."""
    tiny = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
    loop = {"max_steps": 2, "per_device_batch_size": 2, "grad_accum_steps": 1, "max_length": 160}
    loop_eval = loop | {"eval_every": 0, "eval_batches": 1}
    bootstrap = {
        "vocab_size": 400, "hidden_size": 32, "num_layers": 3, "num_heads": 2, "intermediate_size": 64,
        "steps": 20, "batch_size": 8, "seq_len": 160, "cache_dir": str(Path(study_dir).absolute() / "target"),
    }  # fmt: skip
    return [
        f"target.bootstrap={flow(bootstrap)}",
        "data.offline.entries_per_sample=[1, 2]",
        "data.offline.samples_per_pair=80",
        "distill.max_new_tokens=10",
        f"pretrain={flow({'drafter': tiny, 'loop': loop | {'max_length': 128, 'eval_every': 0}})}",
        f"finetune.loop={flow(loop_eval | {'max_steps': 8})}",
        f"early_exit={flow({'num_shared_layers': 1, 'loop': loop_eval})}",
        f"heads={flow({'num_heads': 2, 'loop': loop_eval})}",
        f"calibrate={flow({'num_positions': 12, 'draft_length': 3, 'max_steps': 3, 'loop': {'max_length': 160, 'per_device_batch_size': 6}})}",
        "measure.num_prompts=2",
        "measure.max_draft_length=3",  # Cali-TS within the calibration model's 3 labelled steps
        "measure.max_new_tokens=6",
        "measure.latency_repeats=2",
        "tracking.mode=disabled",
    ]
