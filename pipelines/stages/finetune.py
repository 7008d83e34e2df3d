"""Stage `finetune` (F, seed 003 App. F.3): one drafter per language pair on the distill stage's mix.

Training starts from the pretrain stage's drafter (P-F) or, without a pretrain stage, from
`finetune.drafter` (the seed's F baseline). Loss on the response tokens only (`ce`), plus the forward KL
to the target (`kd`, which loads the target beside the drafter).

Runner side: `run` launches `main` through `accelerate launch` for the pairs not finished by an earlier,
interrupted run. Subprocess side: `finetune`. Output per pair: `<pair>/` (a Hugging Face folder),
`<pair>.metrics.json` (written once the pair's drafter is exported: the pair is done), and while it
trains `<pair>.checkpoints/` and `<pair>.train_log.jsonl`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from polydraft.models.drafters import target_vocab_size
from polydraft.models.loading import load_causal_lm, load_tokenizer
from polydraft.pipelines.schema.inputs import FinetuneInputs
from polydraft.pipelines.stage import (
    StageContext,
    StageFailed,
    StageResult,
    StageSpec,
    launch_training,
    loop_settings,
    optim_settings,
    training_main,
)
from polydraft.pipelines.stages.mix_training import MIX_CACHE, sized_batches
from polydraft.pipelines.stages.pretrain import preflight
from polydraft.pipelines.tracking import Tracker
from polydraft.train.data import pad_id_of
from polydraft.train.drafter import export, initial_drafter, train_drafter
from polydraft.train.evaluation import read_eval_sets
from polydraft.train.mix_cache import load_examples
from polydraft.train.results import DrafterMetrics, FinetuneMetrics, Launched
from polydraft.train.runtime import resolve_attn_implementation

log = logging.getLogger(__name__)


def run(inputs: FinetuneInputs, ctx: StageContext) -> StageResult:
    """Launch one training subprocess for the pairs still to train; return the metrics of every pair."""
    if "distill" not in ctx.upstream:
        raise StageFailed("finetune trains on the distill stage's mix: enable the distill stage")
    pending = [pair for pair in inputs.pairs if not pair_metrics_path(ctx.work_dir, pair).is_file()]
    launched = Launched()
    if pending:
        if "pretrain" not in ctx.upstream:
            drafter = inputs.finetune.drafter
            preflight(ctx.name, drafter.init, drafter.revision, inputs.target)
        todo = inputs.model_copy(update={"pairs": pending})
        launched = Launched.model_validate(
            launch_training(todo, inputs.launch, ctx, "polydraft.pipelines.stages.finetune")
        )
    pairs = {
        pair: DrafterMetrics.model_validate_json(
            pair_metrics_path(ctx.work_dir, pair).read_text(encoding="utf-8")
        )
        for pair in inputs.pairs
    }
    metrics = FinetuneMetrics(pairs=pairs, **launched.model_dump())
    return StageResult(metrics=metrics.model_dump())


def pair_metrics_path(work_dir: Path, pair: str) -> Path:
    """`<pair>.metrics.json`, written once the pair's drafter is exported: the pair is done."""
    return Path(work_dir) / f"{pair}.metrics.json"


def main(argv: list[str] | None = None) -> None:
    """`python -m pipelines.stages.finetune SPEC.json`, started by `accelerate launch` on every process."""
    training_main(argv, FinetuneInputs, lambda inputs: inputs.finetune.loop, finetune)


def finetune(spec: StageSpec, inputs: FinetuneInputs, accelerator: Any, tracker: Tracker) -> dict[str, Any]:
    """One drafter per pair of `inputs.pairs`, each exported to `<pair>/` with its metrics file."""
    from accelerate.utils import set_seed

    block, target, work_dir = inputs.finetune, inputs.target, Path(spec.work_dir)
    loop = block.loop
    distill_dir = Path(spec.upstream["distill"])
    # from the pretrained drafter (P-F), or from finetune.drafter when there is no pretraining (F)
    if "pretrain" in spec.upstream:
        init, revision = str(Path(spec.upstream["pretrain"]) / "model"), None
    else:
        init, revision = block.drafter.init, block.drafter.revision
    tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
    vocab = target_vocab_size(target.path, target.revision, target.trust_remote_code)
    cuda = accelerator.device.type == "cuda"
    teacher = None
    if block.loss == "kd":  # the frozen target beside the drafter (bf16 on a GPU, fp32 on a CPU)
        teacher = load_causal_lm(
            target.path, target.revision, target.dtype, target.trust_remote_code, accelerator.device
        ).requires_grad_(False)
    step_offset = 0
    for pair in inputs.pairs:
        out_dir = work_dir / pair
        try:
            mix = load_examples(
                distill_dir, tokenizer, "train", temperatures=block.temperatures, loss_on="response",
                max_length=loop.max_length, cache_dir=work_dir / MIX_CACHE,
                main_process_first=accelerator.main_process_first, pairs=[pair], need_distilled=True,
            )  # fmt: skip
        except FileNotFoundError as err:
            raise StageFailed(f"finetune: {err}") from err
        except ValueError as err:
            raise StageFailed(
                f"finetune {pair}: {err}; check finetune.temperatures and that distill answered this pair"
            ) from err
        examples, dropped = mix.examples, mix.dropped
        assert loop.epochs is not None, "the recipe loader fills finetune.loop.epochs"
        batches, total_steps = sized_batches(
            f"finetune {pair}", examples, inputs.data_seed, loop, accelerator, pad_id_of(tokenizer)
        )
        log.info("[%s] %d examples (%d over max_length), %d steps", pair, len(examples), dropped, total_steps)
        set_seed(loop.seed)
        model = initial_drafter(
            block.drafter.arch,
            block.drafter.shape(),
            init,
            revision,
            vocab_size=vocab,
            tokenizer=tokenizer,
            pad_id=pad_id_of(tokenizer),
            max_length=loop.max_length,
            attn_implementation=resolve_attn_implementation(loop.attn_implementation, cuda),
            seed=loop.seed,
            target_name=f"target {target.path}",
        )
        evals = read_eval_sets(distill_dir, [pair], tokenizer, loop.max_length)
        model, metrics = train_drafter(
            accelerator, model, batches, evals, tracker, name=f"finetune {pair}", optim=optim_settings(block.optim),
            loop=loop_settings(loop, total_steps), job_dir=out_dir, quiet=spec.quiet,
            pad_id=pad_id_of(tokenizer), log_prefix=f"{pair}/", step_offset=step_offset, teacher=teacher,
            kd=(block.kd_top_k, block.kd_weight),
        )  # fmt: skip
        export(accelerator, model, tokenizer, out_dir)
        if accelerator.is_main_process:
            pair_metrics_path(work_dir, pair).write_text(metrics.model_dump_json(indent=2), encoding="utf-8")
        step_offset += total_steps
        accelerator.free_memory()
    return {}


if __name__ == "__main__":
    main()
