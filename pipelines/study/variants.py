"""The study's variants: each the recipe plus command-line overrides, run in its own run directory.

Every variant turns off what it does not measure (export always; the early-exit, heads and calibration
stages where no finding reads them) so that only the stages its findings need run. Variants whose
stages have the same inputs share them: the runner's keys decide (`pipelines.run.runner.reuse_outputs`), so
the distillation runs once and the pretrained drafter once per training seed.

Trained drafters that a finding compares are trained with every seed of `TRAIN_SEEDS` (their stage's
`loop.seed`), with their measure stage off; one measure-only variant then loads them all as
`measure.extra_drafters`, so that the compared drafters are measured interleaved in one run (the same
prompts, group by group) and each check pairs its arms by training seed and prompt. The early-exit heads
cannot be loaded that way (the measure stage reads one head, its upstream's), so each EESD variant
measures its own.

The seeds' headline tables that do not fit `make study`'s 60 minutes (`headline`: seed 001 Tables 1-3,
seed 002 Exp1 at draft lengths 2-5) are `full` variants, run by `make study-full` (`--only full`).

Settings come from the seeds, not from the results: seed 003's measurement temperatures (0 and 1) and
four distillation temperatures, seed 001's K sweep and preset K=10 (greedy), seed 002's draft length 3
(Exp1, T=0.3) and target budgets with their trees (Exp2, WMT De-En), seed 000's temperatures 0, 0.7, 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from polydraft.pipelines.schema import Recipe
from polydraft.pipelines.study.model import (
    BUDGET_TREES,
    COMPARE,
    F_BUDGETS,
    HEADS,
    K_SWEEP,
    MORE_SHARED_LAYERS,
    PF_BUDGETS,
    RSD_BUDGET,
    SEED_TEMPERATURES,
    TEMPS_COMPARE,
    TRAIN_SEEDS,
    TREE_DEPTH,
    TREES,
    budgets_variant,
    drafter_name,
    eesd_variant,
    f_variant,
    pf_variant,
    temps_variant,
    ts_variant,
)

COMPARE_TEMPERATURES = [0.0, 1.0]
"""Seed 003 Table 1 measures at T=0 and T=1."""
TREE_TEMPERATURES = [0.3]
"""Seed 002 measures WMT at T=0.3 (the trees' exactness at T=0 is the decoders' tests' job)."""
RESCORE_TEMPERATURES = [0.0, 0.7, 1.0]
"""Seed 000 Tables A-D: T = 0, 0.7 and 1."""
TEMPS_FRACTION = 0.25
"""The distillation-temperature item finetunes for a quarter of the recipe's length (time)."""
MIN_SEEDS = 3


@dataclass(frozen=True)
class Variant:
    name: str
    purpose: str
    overrides: tuple[str, ...]
    skip: str | None = None
    """Why this recipe cannot run the variant (its findings are then `not run` with this reason)."""
    full: bool = False
    """Part of `make study-full` only (`--only full`; `--quick` runs it too): a headline table that does
    not fit `make study`'s 60 minutes of stages on 2 cores."""


def flow(value: Any) -> str:
    """A value as one line of YAML, for a `key=value` override."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()


def _measure(**fields: Any) -> str:
    # no mixed traffic: no finding reads it, and variants without finetuned pair drafters cannot route
    defaults = {
        "controls": ["fixed"],
        "k_sweep": [],
        "include_pretrained": False,
        "cross_pairs": False,
        "mixed": False,
    }
    return "measure=" + flow(defaults | fields)


def _finetune_fraction(recipe: Recipe, fraction: float) -> tuple[str, ...]:
    """The recipe's finetune length times `fraction` (its steps when it sets max_steps, else its epochs)."""
    if fraction == 1:
        return ()
    loop = recipe.finetune.loop
    if loop.max_steps is not None:
        return (f"finetune.loop.max_steps={max(1, round(loop.max_steps * fraction))}",)
    assert loop.epochs is not None, "the recipe loader fills finetune.loop.epochs"
    return (f"finetune.loop.epochs={loop.epochs * fraction:g}",)


OFF = (  # the EAGLE-3 heads too: no finding reads them (measured by the demo and bench/eagle3_goals.py)
    "early_exit.enabled=false", "heads.enabled=false", "eagle3.enabled=false", "calibrate.enabled=false",
    "export.enabled=false", "finetune.multilingual=false",
)  # fmt: skip
MEASURE_ONLY = ("distill.enabled=false", "pretrain.enabled=false", "finetune.enabled=false", *OFF)


def _eval_on(recipe: Recipe, pair: str) -> str:
    """`data.eval` cut to the sources of one language pair."""
    return "data.eval=" + flow([s.model_dump(mode="json") for s in recipe.data.eval if s.pair == pair])


def trained(recipe: Recipe, study_dir: Path) -> list[Variant]:
    """The compared standalone drafters, each training seed and budget its own variant (measure off)."""
    out = []
    drafter = flow(recipe.pretrain.drafter.model_dump(mode="json"))
    for seed in TRAIN_SEEDS:
        seeds = (
            f"pretrain.loop.seed={recipe.pretrain.loop.seed + seed}",
            f"finetune.loop.seed={recipe.finetune.loop.seed + seed}",
        )
        for fraction in PF_BUDGETS:
            out.append(Variant(
                pf_variant(seed, fraction),
                f"P-F drafters (pretrain then finetune), training seed {seed}, {fraction:g} of the finetune",
                (*OFF, *seeds, *_finetune_fraction(recipe, fraction), "measure.enabled=false"),
            ))  # fmt: skip
        for fraction in F_BUDGETS:
            out.append(Variant(
                f_variant(seed, fraction),
                f"F drafters (finetune only, the P drafter's shape from random weights), training seed {seed}, "
                f"{fraction:g} of the finetune",
                (*OFF, "pretrain.enabled=false", f"finetune.drafter={drafter}", seeds[1],
                 *_finetune_fraction(recipe, fraction), "measure.enabled=false"),
            ))  # fmt: skip
    return out


def _extras(study_dir: Path, pairs: list[str], budgets: dict[str, tuple[float, ...]], p: bool) -> dict:
    """measure.extra_drafters: the P-F (`pf`) and F (`f`) drafters of `pairs` at their budgets, and the
    pretrained drafters (`p`), of every training seed."""
    found = {}
    for seed in TRAIN_SEEDS:
        for kind, fractions in budgets.items():
            variant = pf_variant if kind == "pf" else f_variant
            for fraction in fractions:
                for pair in pairs:
                    folder = study_dir.absolute() / variant(seed, fraction) / "finetune" / pair
                    found[drafter_name(kind, seed, fraction, pair)] = str(folder)
        if p:
            found[drafter_name("p", seed)] = str(
                study_dir.absolute() / pf_variant(seed, 1.0) / "pretrain" / "model"
            )
    return found


def comparisons(recipe: Recipe, study_dir: Path) -> list[Variant]:
    """Measure-only variants: the trained drafters of `trained` loaded side by side."""
    pairs = list(recipe.data.pairs)
    chain = {"decoders": ["ar", "sd"]}
    full = _extras(study_dir, pairs, {"pf": (1.0,), "f": (1.0,)}, p=True)
    out = [Variant(
        COMPARE,
        "the full-budget P-F, F and P drafters of every training seed, one measure run, every eval set "
        "(in and out of domain), T=0 and T=1, fixed K",
        (*MEASURE_ONLY,
         _measure(**chain, temperatures=COMPARE_TEMPERATURES, cross_pairs=True, extra_drafters=full)),
    )]  # fmt: skip
    for pair in pairs:
        extras = _extras(study_dir, [pair], {"pf": PF_BUDGETS, "f": F_BUDGETS}, p=True)
        out.append(Variant(
            budgets_variant(pair),
            f"the {pair} P-F drafters at every finetune budget, F at its budgets and P, every training seed, "
            f"one measure run on {pair}, T=0, fixed K",
            (*MEASURE_ONLY, _eval_on(recipe, pair), _measure(**chain, temperatures=[0.0], extra_drafters=extras)),
        ))  # fmt: skip
    for pair in pairs:
        extras = _extras(study_dir, [pair], {"pf": (1.0,)}, p=False)
        k = recipe.measure.draft_length
        out.append(Variant(
            ts_variant(pair),
            f"the {pair} full-budget P-F drafters of every training seed on {pair}, greedy: fixed K in "
            f"{list(K_SWEEP)} and Beta-TS",
            (*MEASURE_ONLY, _eval_on(recipe, pair),
             _measure(**chain, temperatures=[0.0], controls=["fixed", "beta_ts"],
                      k_sweep=[s for s in K_SWEEP if s != k], extra_drafters=extras)),
        ))  # fmt: skip
    return out


def decoders(recipe: Recipe) -> list[Variant]:
    """Variants that compare decoders on the recipe's own drafters (training seed 0)."""
    own = (*OFF, "measure.enabled=true")
    first = recipe.data.pairs[0]
    shapes_c = [b for c, _ in BUDGET_TREES.values() for b in c]
    shapes_s = [t for _, s in BUDGET_TREES.values() for t in s]
    trees = Variant(
        TREES,
        f"Exp1: SD K={TREE_DEPTH}, RSD-C 2-2-2 and RSD-S 3x3 (seed 002's draft length {TREE_DEPTH})",
        (*own, _measure(
            decoders=["ar", "sd", "rsd_c", "rsd_s"], draft_length=TREE_DEPTH, branching=[2] * TREE_DEPTH,
            beam_width=3, beam_depth=TREE_DEPTH, temperatures=TREE_TEMPERATURES,
        )),
    )  # fmt: skip
    budget = Variant(
        RSD_BUDGET,
        f"Exp2: fixed target budgets B in {list(BUDGET_TREES)} (SD K=B and seed 002's trees per B) on "
        f"{first}, T=0.3",
        (*own, _eval_on(recipe, first), _measure(
            decoders=["ar", "sd", "rsd_c", "rsd_s"], draft_length=min(BUDGET_TREES),
            k_sweep=list(BUDGET_TREES)[1:], branching=shapes_c[0], rsd_c_trees=shapes_c[1:],
            beam_width=shapes_s[0][0], beam_depth=shapes_s[0][1], rsd_s_trees=shapes_s[1:],
            temperatures=[0.3],
        )),
    )  # fmt: skip
    heads = Variant(
        HEADS,
        "the recipe's heads (Medusa or BPD), alone and rescored by each pair's P-F drafter, T = 0, 0.7, 1",
        (
            "early_exit.enabled=false", "calibrate.enabled=false", "heads.enabled=true", "eagle3.enabled=false",
            "export.enabled=false", "finetune.multilingual=false",  # the rescorers are the pair drafters of `pf_s0_x1`, reused
            _measure(decoders=["ar", "bpd", "medusa", "bpd+rescore", "medusa+rescore"],
                     temperatures=RESCORE_TEMPERATURES),
        ),
    )  # fmt: skip
    return [trees, budget, heads]


def self_speculative(recipe: Recipe) -> list[Variant]:
    """EESD heads: with and without the exit layer, and at more shared layers N, every training seed."""
    k = recipe.measure.eesd_k
    base = (
        "pretrain.enabled=false", "finetune.enabled=false", "heads.enabled=false", "eagle3.enabled=false",
        "early_exit.enabled=true", "export.enabled=false",
    )  # fmt: skip
    sweep = [s for s in K_SWEEP if s != k]
    n0 = recipe.early_exit.num_shared_layers
    layers = recipe.target.bootstrap.num_layers if recipe.target.bootstrap is not None else None
    out = []
    for seed in TRAIN_SEEDS:
        seeded = (*base, f"early_exit.loop.seed={recipe.early_exit.loop.seed + seed}")
        out.append(Variant(
            eesd_variant(seed),
            f"EESD, N={n0}, one exit layer, training seed {seed}: fixed K in {list(K_SWEEP)}, Beta-TS, Cali-TS",
            (*seeded, "early_exit.num_exit_layers=1", "calibrate.enabled=true", "calibrate.drafters=early_exit",
             _measure(decoders=["ar", "eesd"], controls=["fixed", "beta_ts", "cali_ts"], k_sweep=sweep,
                      temperatures=[0.0])),
        ))  # fmt: skip
        out.append(Variant(
            eesd_variant(seed, exit_layers=0),
            f"EESD without the exit layer (norm and head only), training seed {seed}: fixed K, Beta-TS",
            (*seeded, "early_exit.num_exit_layers=0", "calibrate.enabled=false",
             _measure(decoders=["ar", "eesd"], controls=["fixed", "beta_ts"], k_sweep=sweep, temperatures=[0.0])),
        ))  # fmt: skip
        n = n0 + MORE_SHARED_LAYERS
        skip = None
        if layers is not None and n + 1 > layers:
            skip = f"N={n} shared layers and an exit layer need more than the target's {layers} layers"
        out.append(Variant(
            eesd_variant(seed, shared=n),
            f"EESD with N={n} shared layers, one exit layer, training seed {seed}: Beta-TS",
            (*seeded, f"early_exit.num_shared_layers={n}", "early_exit.num_exit_layers=1", "calibrate.enabled=false",
             _measure(decoders=["ar", "eesd"], controls=["beta_ts"], temperatures=[0.0])),
            skip,
        ))  # fmt: skip
    return out


def temperatures_item(recipe: Recipe, study_dir: Path) -> list[Variant]:
    """Not a seed claim: P-F drafters finetuned on seed 003's four distillation temperatures against T=0
    only, with as many distilled rows each (a quarter of the prompts at four temperatures)."""
    sources = [s.model_dump(mode="json") for s in recipe.data.distill]
    skip = None
    if any(s["limit"] is None or s["limit"] < len(SEED_TEMPERATURES) for s in sources):
        skip = "data.distill sources need a `limit` (of at least 4) to distil equal row counts"
    quarter = [s | {"limit": max(1, (s["limit"] or 0) // len(SEED_TEMPERATURES))} for s in sources]
    out = []
    for seed in TRAIN_SEEDS:
        seeds = (
            f"pretrain.loop.seed={recipe.pretrain.loop.seed + seed}",
            f"finetune.loop.seed={recipe.finetune.loop.seed + seed}",
        )
        common = (*OFF, *seeds, *_finetune_fraction(recipe, TEMPS_FRACTION), "measure.enabled=false")
        out.append(Variant(
            temps_variant(seed, four=True),
            f"P-F drafters on distillations at {list(SEED_TEMPERATURES)} of a quarter of the prompts, "
            f"training seed {seed}",
            (*common, f"distill.temperatures={flow(list(SEED_TEMPERATURES))}", "finetune.temperatures=null",
             f"data.distill={flow(quarter)}"),
            skip,
        ))  # fmt: skip
        out.append(Variant(
            temps_variant(seed, four=False),
            f"P-F drafters on the T=0 distillation of all the prompts (as many rows), training seed {seed}",
            (*common, "distill.temperatures=[0.0]", "finetune.temperatures=null"),
            skip,
        ))  # fmt: skip
    extras = {}
    for seed in TRAIN_SEEDS:
        for four in (True, False):
            for pair in recipe.data.pairs:
                folder = study_dir.absolute() / temps_variant(seed, four) / "finetune" / pair
                extras[drafter_name(f"t{4 if four else 0}", seed, None, pair)] = str(folder)
    out.append(Variant(
        TEMPS_COMPARE,
        "the four-temperature and T=0 drafters of every training seed in one measure run, T=0 and T=1",
        (*MEASURE_ONLY, _measure(decoders=["ar", "sd"], temperatures=COMPARE_TEMPERATURES, extra_drafters=extras)),
        skip,
    ))  # fmt: skip
    return out


def variants(recipe: Recipe, study_dir: Path) -> list[Variant]:
    """The variants of `recipe`, in the order they run (each reuses what the earlier ones made; the
    measure-only comparisons come after the drafters they load); `make study-full`'s last."""
    from polydraft.pipelines.study.variants_full import full_variants  # it builds on this module

    return [
        *trained(recipe, study_dir),
        *comparisons(recipe, study_dir),
        *decoders(recipe),
        *self_speculative(recipe),
        *temperatures_item(recipe, study_dir),
        *full_variants(recipe, study_dir),
    ]


def quick_overrides(study_dir: Path) -> list[str]:
    """`--quick`: tiny models and data for a demo-shaped recipe (a bootstrap target, offline data), so that
    the whole study runs in the test suite (its stages trained in the study's process: `run_in_process`;
    distillation and measurement in it too, one process each, not the recipe's two subprocesses). Its
    numbers say nothing; its report has every part."""
    tiny = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
    loop = {"max_steps": 2, "per_device_batch_size": 2, "grad_accum_steps": 1, "max_length": 160}
    loop_eval = loop | {"eval_every": 0, "eval_batches": 1}
    bootstrap = {
        "vocab_size": 400, "hidden_size": 32, "num_layers": 4, "num_heads": 2, "intermediate_size": 64,
        "steps": 20, "batch_size": 8, "seq_len": 160, "cache_dir": str(Path(study_dir).absolute() / "target"),
    }  # fmt: skip
    return [
        f"target.bootstrap={flow(bootstrap)}",
        "data.offline.entries_per_sample=[1, 2]",
        "data.offline.samples_per_pair=80",
        "distill.max_new_tokens=10",
        "distill.hf.processes=1",
        f"pretrain={flow({'drafter': tiny, 'loop': loop | {'max_length': 128, 'eval_every': 0}})}",
        f"finetune.loop={flow(loop_eval | {'max_steps': 8})}",
        f"early_exit={flow({'num_shared_layers': 1, 'loop': loop_eval})}",
        f"heads={flow({'num_heads': 2, 'loop': loop_eval})}",
        f"calibrate={flow({'num_positions': 12, 'draft_length': 3, 'max_steps': 3, 'loop': {'max_length': 160, 'per_device_batch_size': 6}})}",
        "measure.num_prompts=2",
        "measure.processes=1",
        "measure.max_draft_length=3",  # Cali-TS within the calibration model's 3 labelled steps
        "measure.max_new_tokens=6",
        "measure.latency_repeats=2",
        "tracking.mode=disabled",
    ]
