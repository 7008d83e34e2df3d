"""Stage `finetune` (F, seed 003 App. F.3): one drafter per language pair on the distill stage's mix.

Training starts from the pretrain stage's drafter (P-F) or, without a pretrain stage, from
`finetune.drafter` (the seed's F baseline). Loss on the response tokens only (`ce`), plus the forward KL
to the target (`kd`, which loads the target beside the drafter).

Runner side: `run` launches `main` through `accelerate launch` for the pairs not finished by an earlier,
interrupted run. Subprocess side: `finetune`. Output per pair: `<pair>/` (a Hugging Face folder),
`<pair>.metrics.json` (written once the pair's drafter is exported: the pair is done), and while it
trains `<pair>.checkpoints/` and `<pair>.train_log.jsonl`. With `finetune.multilingual`, the same for
one more drafter, `multilingual`, trained from the same starting drafter on the union of every pair's
mix balanced by pair (`train.mix_cache.balanced_union`; its rows per pair go into its metrics).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from polydraft.data.prompts import MULTILINGUAL
from polydraft.models.drafters import DrafterMismatch, check_init_for_target, target_vocab_size
from polydraft.models.loading import load_causal_lm, load_tokenizer
from polydraft.pipelines.runtime.contract import StageContext, StageFailed, StageResult, StageSpec
from polydraft.pipelines.runtime.launch import launch_training
from polydraft.pipelines.runtime.process import loop_settings, optim_settings, training_main
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.schema.inputs import FinetuneInputs
from polydraft.pipelines.stages.mix_training import (
    MIX_CACHE,
    pair_jobs,
    read_metrics,
    sized_batches,
    unfinished,
    write_metrics,
)
from polydraft.train.data import pad_id_of
from polydraft.train.drafter import export, initial_drafter, train_drafter
from polydraft.train.evaluation import read_eval_sets
from polydraft.train.loop import TrainJob
from polydraft.train.mix_cache import MixExamples, balanced_union, load_examples
from polydraft.train.runtime import resolve_attn_implementation
from polydraft.train.stage_metrics import DrafterMetrics, FinetuneMetrics, Launched, MultilingualMetrics

log = logging.getLogger(__name__)


def run(inputs: FinetuneInputs, ctx: StageContext) -> StageResult:
    """Launch one training subprocess for the drafters still to train; return the metrics of every one."""
    todo = unfinished("finetune", inputs, ctx, pair_jobs(inputs.pairs, inputs.finetune.multilingual))
    launched = Launched()
    if todo is not None:
        drafter, target = inputs.finetune.drafter, inputs.target
        try:  # a drafter checkpoint with another vocabulary fails here, before any process is launched
            if "pretrain" not in ctx.upstream and drafter.init is not None:
                check_init_for_target(drafter.init, drafter.revision, target.path, target.revision, target.trust_remote_code)  # fmt: skip
        except DrafterMismatch as err:
            raise StageFailed(f"{ctx.name}: {err}") from err
        launched = Launched.model_validate(
            launch_training(todo, inputs.launch, ctx, "polydraft.pipelines.stages.finetune")
        )
    pairs = {pair: read_metrics(ctx.work_dir, pair, DrafterMetrics) for pair in inputs.pairs}
    multilingual = None
    if inputs.finetune.multilingual:
        multilingual = read_metrics(ctx.work_dir, MULTILINGUAL, MultilingualMetrics)
    metrics = FinetuneMetrics(pairs=pairs, multilingual=multilingual, **launched.model_dump())
    return StageResult(metrics=metrics.model_dump())


def main(argv: list[str] | None = None) -> None:
    """`python -m pipelines.stages.finetune SPEC.json`, started by `accelerate launch` on every process."""
    training_main(argv, FinetuneInputs, lambda inputs: inputs.finetune.loop, finetune)


def finetune(spec: StageSpec, inputs: FinetuneInputs, accelerator: Any, tracker: Tracker) -> dict[str, Any]:
    """One drafter per pair of `inputs.pairs`, each exported to `<pair>/` with its metrics file, and with
    `finetune.multilingual` one on the balanced union of every pair's mix, `multilingual/`. Drafters in
    `inputs.done` are skipped."""
    block, work_dir = inputs.finetune, Path(spec.work_dir)
    job = Job(spec, inputs, accelerator, tracker)
    step_offset = 0
    for pair in inputs.pairs:
        if pair in inputs.done:
            continue
        mix = job.mix(pair)
        metrics, steps = job.train(pair, mix.examples, mix.dropped, [pair], step_offset)
        write_metrics(accelerator, work_dir, pair, metrics)
        step_offset += steps
    if block.multilingual and MULTILINGUAL not in inputs.done:
        # the same encoded rows as the per-pair drafters (the tokenized mix is cached per pair)
        mixes = {pair: job.mix(pair) for pair in inputs.pairs}
        try:
            union, rows = balanced_union(
                {pair: mix.examples for pair, mix in mixes.items()}, inputs.data_seed
            )
        except ValueError as err:
            raise StageFailed(f"finetune {MULTILINGUAL}: {err}") from err
        dropped = sum(mix.dropped for mix in mixes.values())
        log.info("[%s] balanced rows per pair: %s", MULTILINGUAL, rows)
        metrics, _ = job.train(MULTILINGUAL, union, dropped, list(inputs.pairs), step_offset)
        result = MultilingualMetrics(
            drafter=metrics,
            examples_per_pair={pair: len(mix.examples) for pair, mix in mixes.items()},
            rows_per_pair=rows,
        )
        write_metrics(accelerator, work_dir, MULTILINGUAL, result)
    return {}


class Job:
    """What every drafter of the stage shares: the starting drafter, the tokenizer, the teacher."""

    def __init__(self, spec: StageSpec, inputs: FinetuneInputs, accelerator: Any, tracker: Tracker):
        block, target = inputs.finetune, inputs.target
        self.spec, self.inputs, self.accelerator, self.tracker = spec, inputs, accelerator, tracker
        self.work_dir, self.distill_dir = Path(spec.work_dir), Path(spec.upstream["distill"])
        # from the pretrained drafter (P-F), or from finetune.drafter when there is no pretraining (F)
        if "pretrain" in spec.upstream:
            self.init, self.revision = str(Path(spec.upstream["pretrain"]) / "model"), None
        else:
            self.init, self.revision = block.drafter.init, block.drafter.revision
        self.tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
        self.vocab = target_vocab_size(target.path, target.revision, target.trust_remote_code)
        self.teacher = None
        if block.loss == "kd":  # the frozen target beside the drafter (bf16 on a GPU, fp32 on a CPU)
            self.teacher = load_causal_lm(
                target.path, target.revision, target.dtype, target.trust_remote_code, accelerator.device
            ).requires_grad_(False)

    def mix(self, pair: str) -> MixExamples:
        """The pair's encoded training rows (StageFailed naming the pair when there are none to train on)."""
        block = self.inputs.finetune
        try:
            return load_examples(
                self.distill_dir, self.tokenizer, "train", temperatures=block.temperatures,
                loss_on="response", max_length=block.loop.max_length, cache_dir=self.work_dir / MIX_CACHE,
                main_process_first=self.accelerator.main_process_first, pairs=[pair], need_distilled=True,
            )  # fmt: skip
        except FileNotFoundError as err:
            raise StageFailed(f"finetune: {err}") from err
        except ValueError as err:
            raise StageFailed(
                f"finetune {pair}: {err}; check finetune.temperatures and that distill answered this pair"
            ) from err

    def train(
        self, name: str, examples: Any, dropped: int, eval_pairs: list[str], step_offset: int
    ) -> tuple[DrafterMetrics, int]:
        """Train the drafter `name` on `examples` from the starting drafter, export it to `<name>/`;
        (its metrics, its optimizer steps)."""
        from accelerate.utils import set_seed

        block, target, accelerator, tokenizer = (
            self.inputs.finetune,
            self.inputs.target,
            self.accelerator,
            self.tokenizer,
        )
        loop, out_dir = block.loop, self.work_dir / name
        assert loop.epochs is not None, "the recipe loader fills finetune.loop.epochs"
        batches, total_steps = sized_batches(
            f"finetune {name}", examples, self.inputs.data_seed, loop, accelerator, pad_id_of(tokenizer)
        )
        log.info("[%s] %d examples (%d over max_length), %d steps", name, len(examples), dropped, total_steps)
        set_seed(loop.seed)
        model = initial_drafter(
            block.drafter.arch,
            block.drafter.shape(),
            self.init,
            self.revision,
            vocab_size=self.vocab,
            tokenizer=tokenizer,
            pad_id=pad_id_of(tokenizer),
            max_length=loop.max_length,
            attn_implementation=resolve_attn_implementation(
                loop.attn_implementation, accelerator.device.type == "cuda"
            ),
            seed=loop.seed,
            target_name=f"target {target.path}",
        )
        evals = read_eval_sets(self.distill_dir, eval_pairs, tokenizer, loop.max_length)
        job = TrainJob.beside(
            out_dir, f"finetune {name}", self.tracker, self.spec.quiet, f"{name}/", step_offset
        )
        model, metrics = train_drafter(
            accelerator, model, batches, evals, optim_settings(block.optim), loop_settings(loop, total_steps), job,
            pad_id_of(tokenizer), (self.teacher, block.kd_top_k, block.kd_weight),
        )  # fmt: skip
        export(accelerator, model, tokenizer, out_dir)
        accelerator.free_memory()
        return metrics, total_steps


if __name__ == "__main__":
    main()
