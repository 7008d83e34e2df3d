"""The variants of `make study-full` (`Variant.full`): the seeds' headline tables that do not fit `make
study`'s 60 minutes of stages on 2 cores, built like `pipelines.study.variants`' (whose docstring says how
variants share stages and measure drafters interleaved) and run after them, so that they reuse their
stage folders by key."""

from __future__ import annotations

import json
from pathlib import Path

from polydraft.pipelines.schema import Recipe
from polydraft.pipelines.study.model import (
    DEPTH_FACTORS,
    DEPTHS_COMPARE,
    DOMAIN_IO,
    HEADLINE_K,
    IO_DRAFTER,
    IO_PAIRS,
    LENGTH_TREES,
    LONG_CONTROLS,
    LONG_ENTRIES,
    LONG_TOKENS_FACTOR,
    TRAIN_SEEDS,
    TREES_LENGTHS,
    depth_variant,
    drafter_name,
    eesd_long_variant,
    eesd_open_variant,
    eesd_variant,
    headline_variant,
    pf_variant,
    sd_medusa_variant,
)
from polydraft.pipelines.study.variants import (
    COMPARE_TEMPERATURES,
    MEASURE_ONLY,
    OFF,
    TREE_TEMPERATURES,
    Variant,
    _measure,
    flow,
)


def headline(recipe: Recipe) -> list[Variant]:
    """`make study-full`: seed 001's main table (EESD against vanilla SD and Medusa) measured interleaved
    in one run per training seed, each of the three trained with that seed (the EESD head and its
    calibration model, the pair drafters and the heads are those of `eesd_s*`, `pf_s*_x1` and, for seed 0,
    `heads`, reused by key), and seed 002's Exp1 at every draft length it reports (2-5, App. C.3.1's
    trees)."""
    out = []
    for seed in TRAIN_SEEDS:
        out.append(Variant(
            headline_variant(seed),
            f"seed 001 Tables 1-3, training seed {seed}: EESD (one exit layer) under Beta-TS and Cali-TS, sd at "
            f"the seed's fixed K={HEADLINE_K} with the pair's P-F drafter, and Medusa, one measure run, T=0",
            (
                f"pretrain.loop.seed={recipe.pretrain.loop.seed + seed}",
                f"finetune.loop.seed={recipe.finetune.loop.seed + seed}",
                f"early_exit.loop.seed={recipe.early_exit.loop.seed + seed}",
                f"heads.loop.seed={recipe.heads.loop.seed + seed}",
                "early_exit.enabled=true", "early_exit.num_exit_layers=1", "calibrate.enabled=true",
                "calibrate.drafters=early_exit", "heads.enabled=true", "eagle3.enabled=false",
                "export.enabled=false", "finetune.multilingual=false",
                _measure(decoders=["ar", "sd", "eesd", "medusa"], controls=["fixed", "beta_ts", "cali_ts"],
                         draft_length=HEADLINE_K, eesd_draft_length=HEADLINE_K, temperatures=[0.0]),
            ),
            full=True,
        ))  # fmt: skip
    for seed in TRAIN_SEEDS:
        out.append(Variant(
            sd_medusa_variant(seed),
            f"seed 003 Table 1, training seed {seed}: sd with each pair's P-F drafter at the recipe's K and "
            "Medusa, one measure run, T=0 and T=1",
            (
                f"pretrain.loop.seed={recipe.pretrain.loop.seed + seed}",
                f"finetune.loop.seed={recipe.finetune.loop.seed + seed}",
                f"heads.loop.seed={recipe.heads.loop.seed + seed}",
                "early_exit.enabled=false", "calibrate.enabled=false", "heads.enabled=true",
                "eagle3.enabled=false", "export.enabled=false", "finetune.multilingual=false",
                _measure(decoders=["ar", "sd", "medusa"], temperatures=COMPARE_TEMPERATURES),
            ),
            full=True,
        ))  # fmt: skip
    lengths = sorted(LENGTH_TREES)
    c_trees = [b for length in lengths for b in LENGTH_TREES[length][0]]
    s_trees = [t for length in lengths for t in LENGTH_TREES[length][1]]
    out.append(Variant(
        TREES_LENGTHS,
        f"seed 002 Exp1 at draft lengths L in {lengths}: SD K=L and App. C.3.1's RSD-C and RSD-S trees per L, "
        "T=0.3, each pair's drafter on its own pair",
        (*OFF, "measure.enabled=true", _measure(
            decoders=["ar", "sd", "rsd_c", "rsd_s"], draft_length=lengths[0], k_sweep=lengths[1:],
            branching=c_trees[0], rsd_c_trees=c_trees[1:], beam_width=s_trees[0][0], beam_depth=s_trees[0][1],
            rsd_s_trees=s_trees[1:], temperatures=TREE_TEMPERATURES,
        )),
        full=True,
    ))  # fmt: skip
    return out


def drafter_sizes(recipe: Recipe, study_dir: Path) -> list[Variant]:
    """`make study-full`: P-F drafters at the depths of `DEPTH_FACTORS` (the recipe's own depth is
    `pf_s*_x1`), every training seed, then one measure-only run of all of them (seed 003 Table 5)."""
    base = recipe.pretrain.drafter.num_layers
    skip = None if base is not None else "pretrain.drafter names no num_layers (a named architecture)"
    depths = [(base or 1) * f for f in DEPTH_FACTORS]
    out, extras = [], {}
    for seed in TRAIN_SEEDS:
        seeds = (
            f"pretrain.loop.seed={recipe.pretrain.loop.seed + seed}",
            f"finetune.loop.seed={recipe.finetune.loop.seed + seed}",
        )
        for depth in depths:
            name = depth_variant(seed, depth, base or 1)
            for pair in recipe.data.pairs:
                extras[drafter_name(f"d{depth}", seed, None, pair)] = str(
                    study_dir.absolute() / name / "finetune" / pair
                )
            if depth != base:
                out.append(Variant(
                    name, f"P-F drafters of {depth} layers, training seed {seed}",
                    (*OFF, *seeds, f"pretrain.drafter.num_layers={depth}", "measure.enabled=false"), skip, full=True,
                ))  # fmt: skip
    out.append(Variant(
        DEPTHS_COMPARE,
        f"the P-F drafters of {depths} layers, every training seed, one measure run on their own pairs, T=0, "
        "fixed K",
        (*MEASURE_ONLY, _measure(decoders=["ar", "sd"], temperatures=[0.0], extra_drafters=extras)),
        skip,
        full=True,
    ))  # fmt: skip
    return out


def thompson(recipe: Recipe) -> list[Variant]:
    """EESD's controls in the seed's setting, every training seed: long answers (`LONG_ENTRIES`) under
    fixed K=10, Beta-TS (as read and as written), Cali-TS and its two ablations (seed 001 Table 4), and
    heads of 2 exit layers (Fig. 5); the heads and calibration models are `eesd_s*`'s, reused by key."""
    base = (
        "pretrain.enabled=false", "finetune.enabled=false", "heads.enabled=false", "eagle3.enabled=false",
        "early_exit.enabled=true", "export.enabled=false",
    )  # fmt: skip
    tokens = round(recipe.measure.max_new_tokens * LONG_TOKENS_FACTOR)
    long_eval = [
        s.model_dump(mode="json") | {"entries_per_sample": list(LONG_ENTRIES)} for s in recipe.data.eval
    ]
    out = []
    for seed in TRAIN_SEEDS:
        seeded = (*base, f"early_exit.loop.seed={recipe.early_exit.loop.seed + seed}")
        out.append(Variant(
            eesd_long_variant(seed),
            f"EESD on long answers ({LONG_ENTRIES[0]}-{LONG_ENTRIES[1]} entries a sample, up to {tokens} "
            f"tokens), training seed {seed}: fixed K={HEADLINE_K}, Beta-TS as read and as written, Cali-TS "
            "and its two ablations, T=0",
            (*seeded, "early_exit.num_exit_layers=1", "calibrate.enabled=true", "calibrate.drafters=early_exit",
             f"data.eval={flow(long_eval)}",
             _measure(decoders=["ar", "eesd"], controls=LONG_CONTROLS, eesd_draft_length=HEADLINE_K,
                      max_new_tokens=tokens, temperatures=[0.0])),
            full=True,
        ))  # fmt: skip
        out.append(Variant(
            eesd_variant(seed, exit_layers=2),
            f"EESD with 2 exit layers, training seed {seed}: Beta-TS, T=0",
            (*seeded, "early_exit.num_exit_layers=2", "calibrate.enabled=false",
             _measure(decoders=["ar", "eesd"], controls=["beta_ts"], temperatures=[0.0])),
            full=True,
        ))  # fmt: skip
        out.append(Variant(
            eesd_open_variant(seed),
            f"EESD trained without self-distillation (the open rows, as many), training seed {seed}: Beta-TS, T=0",
            (*seeded, "early_exit.num_exit_layers=1", "calibrate.enabled=false", *open_only(recipe),
             _measure(decoders=["ar", "eesd"], controls=["beta_ts"], temperatures=[0.0])),
            None if open_only(recipe) else "needs data.open, distill.open_fraction > 0 and a limit on every "
            "data.distill source (to keep the mix's size)",
            full=True,
        ))  # fmt: skip
    return out


def open_only(recipe: Recipe) -> tuple[str, ...]:
    """Overrides that make the distill stage's mix open rows but for one distilled prompt a source (the
    stage needs one), as many rows as the recipe's mix: a source's `limit` prompts at every distillation
    temperature with `open_fraction` times as many open rows become 1 prompt and `limit (1 + fraction) - 1`
    times as many (seed 001 Table 4's "w/o Self-Distillation": trained on open-source data only)."""
    sources = [json.loads(s.model_dump_json()) for s in recipe.data.distill]
    limits = {s["limit"] for s in sources}
    fraction = recipe.distill.open_fraction
    if not recipe.data.open or fraction <= 0 or None in limits or len(limits) != 1:
        return ()
    (limit,) = limits
    return (
        f"data.distill={flow([s | {'limit': 1} for s in sources])}",
        f"distill.open_fraction={limit * (1 + fraction) - 1:g}",
    )


def domain_io(recipe: Recipe, study_dir: Path) -> list[Variant]:
    """Seed 003 Fig. 5: input vs output domain. The De-En P-F drafters of every training seed (`pf_s*_x1`)
    on the recipe's eval sets and on De-Fr and En-De (the recipe's first eval source with the pair changed),
    one measure-only run at T=0 (the seed's speculative greedy sampling)."""
    skip = (
        None
        if IO_DRAFTER in recipe.data.pairs and recipe.data.eval
        else f"the recipe has no {IO_DRAFTER} pair"
    )
    sources = [json.loads(s.model_dump_json()) for s in recipe.data.eval]
    known = {s["pair"] for s in sources}
    sources += [json.loads(recipe.data.eval[0].model_copy(update={"pair": p}).model_dump_json()) for p in IO_PAIRS if p not in known] if not skip else []  # fmt: skip
    pairs = list(dict.fromkeys([*recipe.data.pairs, *(s["pair"] for s in sources)]))
    extras = {
        drafter_name("pf", seed, 1.0, IO_DRAFTER): str(study_dir.absolute() / pf_variant(seed, 1.0) / "finetune" / IO_DRAFTER)
        for seed in TRAIN_SEEDS
    }  # fmt: skip
    return [Variant(
        DOMAIN_IO,
        f"the {IO_DRAFTER} P-F drafters of every training seed on {pairs}, one measure run, T=0, fixed K",
        (*MEASURE_ONLY, f"data.pairs={flow(pairs)}", f"data.eval={flow(sources)}",
         _measure(decoders=["ar", "sd"], temperatures=[0.0], cross_pairs=True, extra_drafters=extras)),
        skip,
        full=True,
    )]  # fmt: skip


def full_variants(recipe: Recipe, study_dir: Path) -> list[Variant]:
    """Every `make study-full` variant, in the order they run."""
    return [
        *headline(recipe),
        *drafter_sizes(recipe, study_dir),
        *thompson(recipe),
        *domain_io(recipe, study_dir),
    ]
