"""What a run will write to disk, by what writes it: `polydraft check` compares it with the run directory's
free space."""

from __future__ import annotations

from polydraft.pipelines.plan.estimate import answer_tokens, prompt_tokens, source_rows
from polydraft.pipelines.runtime.cluster import (
    CHECKPOINT_BYTES_PER_PARAM,
    EXPORT_BYTES_PER_PARAM,
    MIX_CACHE_BYTES_PER_TOKEN,
    RECORD_BYTES_PER_TOKEN,
    drafter_size,
    target_shape,
)
from polydraft.pipelines.schema import Recipe


def disk_estimate(recipe: Recipe) -> dict[str, float]:
    """Bytes the run will write, by what writes them: the distilled records and the mix, each trainer's
    tokenized mix, its checkpoints (`keep_checkpoints` of them, each drafter's or head's), the exports.
    PlanError when a source or the target cannot be sized."""
    target = target_shape(recipe.target)
    drafter = drafter_size(recipe.pretrain.drafter if recipe.pretrain.enabled else recipe.finetune.drafter,
                           target.vocab)  # fmt: skip
    d, out = recipe.distill, {}
    per_prompt = (0.0 in d.temperatures) + d.samples_per_prompt * sum(t > 0 for t in d.temperatures)
    tokens = 0.0
    for source in recipe.data.distill if d.enabled else []:
        requests = source_rows(source, recipe, "distill") / d.num_shards * per_prompt
        tokens += requests * (prompt_tokens(source, recipe) + answer_tokens(source, d.max_new_tokens))
    out["distill records and mix"] = tokens * RECORD_BYTES_PER_TOKEN * (2 + d.open_fraction)
    pairs = len(recipe.data.pairs) or 1
    trainers = []  # (stage, trained parameters per model, models, its loop)
    if recipe.pretrain.enabled:
        trainers.append(("pretrain", drafter.params(), 1, recipe.pretrain.loop))
    if recipe.finetune.enabled:
        trainers.append(
            ("finetune", drafter.params(), pairs + recipe.finetune.multilingual, recipe.finetune.loop)
        )
    if recipe.early_exit.enabled:
        e = recipe.early_exit
        exit_layers = e.num_exit_layers * target.layer_params() + target.vocab * target.hidden
        trainers.append(("early_exit", exit_layers, 1, e.loop))
    if recipe.eagle3.enabled:
        e = recipe.eagle3
        head = (
            4 * target.hidden * target.hidden
            + target.layer_params()
            + min(e.draft_vocab_size, target.vocab) * target.hidden
        )
        trainers.append(("eagle3", head, pairs + e.multilingual, e.loop))
    for stage, params, models, loop in trainers:
        out[f"{stage} checkpoints"] = params * models * CHECKPOINT_BYTES_PER_PARAM * loop.keep_checkpoints
        if stage != "pretrain":
            out[f"{stage} tokenized mix"] = tokens * (1 + d.open_fraction) * MIX_CACHE_BYTES_PER_TOKEN
        if stage != "pretrain" or recipe.export.include_pretrained:
            out[f"{stage} exports"] = params * models * EXPORT_BYTES_PER_PARAM * recipe.export.enabled
    return out
