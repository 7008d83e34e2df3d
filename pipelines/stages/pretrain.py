"""Stage `pretrain` (P, seed 003 §2.3): causal-LM training of the drafter on generic text, on the target's
vocabulary.

Runner side: `run` checks a drafter checkpoint's vocabulary, then launches `main` through `accelerate
launch` with the recipe's accelerate config. Subprocess side: `pretrain` packs `data.pretrain` documents
into `max_length` sequences (loss on every token) and trains until `pretrain.token_budget` tokens are
spent (or `loop.epochs` passes over a corpus that does not stream). Output: `model/`, a Hugging Face
folder; `model.checkpoints/` and `model.train_log.jsonl` let a killed run resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polydraft.models.drafters import DrafterMismatch, check_init_for_target, target_vocab_size
from polydraft.models.loading import load_tokenizer
from polydraft.pipelines.runtime.contract import StageContext, StageFailed, StageResult, StageSpec
from polydraft.pipelines.runtime.launch import launch_training
from polydraft.pipelines.runtime.process import loop_settings, optim_settings, training_main
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.schema.common import reader_args
from polydraft.pipelines.schema.inputs import PretrainInputs
from polydraft.train.data import PackedBatches, pad_id_of
from polydraft.train.drafter import export, initial_drafter, pretrain_steps, train_drafter
from polydraft.train.loop import TrainJob
from polydraft.train.runtime import resolve_attn_implementation
from polydraft.train.stage_metrics import PretrainMetrics
from polydraft.train.stream import documents as document_stream


def run(inputs: PretrainInputs, ctx: StageContext) -> StageResult:
    """Launch the training subprocess, return its metrics."""
    if not inputs.corpora:
        raise StageFailed(
            "pretrain: data.pretrain lists no corpus (e.g. C4 streaming, ShareGPT, or the offline text)"
        )
    drafter, target = inputs.pretrain.drafter, inputs.target
    try:  # a drafter checkpoint with another vocabulary fails here, before any process is launched
        if drafter.init is not None:
            check_init_for_target(drafter.init, drafter.revision, target.path, target.revision, target.trust_remote_code)  # fmt: skip
    except DrafterMismatch as err:
        raise StageFailed(f"{ctx.name}: {err}") from err
    metrics = launch_training(inputs, inputs.launch, ctx, "polydraft.pipelines.stages.pretrain")
    return StageResult(metrics=PretrainMetrics.model_validate(metrics).model_dump())


def main(argv: list[str] | None = None) -> None:
    """`python -m pipelines.stages.pretrain SPEC.json`, started by `accelerate launch` on every process."""
    training_main(argv, PretrainInputs, lambda inputs: inputs.pretrain.loop, pretrain)


def pretrain(spec: StageSpec, inputs: PretrainInputs, accelerator: Any, tracker: Tracker) -> dict[str, Any]:
    from accelerate.utils import set_seed

    block, target, work_dir = inputs.pretrain, inputs.target, Path(spec.work_dir)
    loop = block.loop
    set_seed(loop.seed)
    tokenizer = load_tokenizer(target.path, target.revision, target.trust_remote_code)
    drafter = block.drafter
    model = initial_drafter(
        drafter.arch,
        drafter.shape(),
        drafter.init,
        drafter.revision,
        vocab_size=target_vocab_size(target.path, target.revision, target.trust_remote_code),
        tokenizer=tokenizer,
        pad_id=pad_id_of(tokenizer),
        max_length=loop.max_length,
        attn_implementation=resolve_attn_implementation(
            loop.attn_implementation, accelerator.device.type == "cuda"
        ),
        seed=loop.seed,
        target_name=f"target {target.path}",
    )
    sources = [reader_args(s, inputs.data_seed, inputs.offline) for s in inputs.corpora]

    def documents(start: dict[str, Any] | None) -> Any:
        return document_stream(
            tokenizer, sources, inputs.data_seed, start, block.data_workers,
            accelerator.process_index, accelerator.num_processes,
        )  # fmt: skip

    batches = PackedBatches(
        documents,
        loop.max_length,
        tokenizer.eos_token_id,
        loop.per_device_batch_size,
        accelerator.num_processes,
        accelerator.gradient_accumulation_steps,
    )
    total_steps = pretrain_steps(
        tokenizer, sources, inputs.data_seed, max_steps=loop.max_steps, epochs=loop.epochs,
        max_length=loop.max_length, token_budget=block.token_budget, global_batch=batches.global_batch,
    )  # fmt: skip
    job = TrainJob.beside(work_dir / "model", "pretrain", tracker, spec.quiet, "pretrain/")
    model, metrics = train_drafter(
        accelerator, model, batches, {}, optim_settings(block.optim), loop_settings(loop, total_steps), job,
        pad_id_of(tokenizer),
    )  # fmt: skip
    export(accelerator, model, tokenizer, work_dir / "model")
    return {"drafter": metrics.model_dump()}


if __name__ == "__main__":
    main()
